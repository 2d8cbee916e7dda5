"""Dorylus: full-graph GNN training on CPU graph servers and serverless tensor functions.

Kept free of torch imports so that torch-free roles (the Lambda function, the wire protocol)
can import submodules of this package.
"""

__version__ = "0.1.0"
