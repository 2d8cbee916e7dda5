"""``dorylus plan``: predict epoch time, dollars and value before renting anything (DESIGN §8).

* :mod:`~dorylus.plan.calibration`: this machine's rates per task kind (one thread), saved and
  loaded as JSON;
* :mod:`~dorylus.plan.runtime`: what the local runtime costs beyond the kernels, from short
  real runs, and the whole calibration (:func:`~dorylus.plan.runtime.measure`);
* :mod:`~dorylus.plan.catalog`: instance types, GPUs, Lambda and the workloads, with sources;
* :mod:`~dorylus.plan.environment`: the rates and links of a role on this machine or on AWS;
* :mod:`~dorylus.plan.model`: one epoch of the model's plan (GCN, GAT, SAGE) from those rates, priced;
* :mod:`~dorylus.plan.planner`: which configurations to predict (at scale, or a local run);
* :mod:`~dorylus.plan.command`: the command's options and tables.
"""
