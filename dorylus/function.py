"""The tensor function: the one serverless function of a deployment (:mod:`lambdas.handler`),
which runs the tensor stages of every model. Its name is the one Terraform deploys it under
(``${var.name}-tensor`` with the default cluster name ``dorylus``), the one the local emulator
serves it under, and the graph servers' default ``--function-name``."""

FUNCTION_NAME = "dorylus-tensor"
FUNCTION_HANDLER = "lambdas.handler:handler"
