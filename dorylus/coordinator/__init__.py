"""The coordinator: the process that runs ``dorylus train``. It prepares the data, starts or
reaches the roles, drives the epochs, checkpoints and recovers.

==============  ===========================================================================
module          what it holds
==============  ===========================================================================
training        the entry points: ``run_training`` (new local run), ``run_cluster_training``
                (cluster mode), ``resume_training``; the single-process ``ReferenceTrainer``;
                the epoch loop shared by every trainer (metrics, checkpoints, the summary)
trainer         ``DistributedTrainer``: the training loop of a run of roles, its recovery
cluster         ``Cluster``: what the loop needs of the roles, wherever they run
errors          ``ClusterError``, ``RoleDied`` (the one a run recovers from)
local           ``LocalCluster``: roles forked on this machine (:mod:`dorylus.zygote`), their
                sockets and logs, the backend's local services, ``--preempt``
remote          ``RemoteCluster``: roles already running elsewhere (cluster mode), their
                greeting, the heartbeat watchdog
clusterfile     the cluster file (``dorylus-cluster/1``) that names those roles
watchdog        ``Watchdog``: the bound on a step, and what it names when a step hangs
==============  ===========================================================================
"""
