# The tensor function: the zip from `dorylus package-lambda`, in the cluster's private subnet.
# The servers invoke it synchronously (RequestResponse) and relaunch a call that fails or runs
# late, so Lambda's own retries, destinations and dead-letter queues (asynchronous only) do not
# apply.

locals {
  # The function's CURVE keys, read by dorylus/curve.py (keys_from_env): its own pair and the
  # public keys of the servers it dials, taken from the SSM parameters into the environment,
  # which Lambda encrypts with the cluster's key. The function itself cannot reach SSM (no
  # endpoint, no permission), and needs no call to read them. No keys, no variables: the
  # servers then run without CURVE and `dorylus train --cluster` refuses them.
  function_curve_env = merge(
    { for role in ["function", "graphserver", "paramserver"] :
      "DORYLUS_CURVE_${upper(role)}_PUBLIC" => aws_ssm_parameter.curve_public[role].value
      if contains(keys(var.curve_public_keys), role)
    },
    { for role in ["function"] :
      "DORYLUS_CURVE_${upper(role)}_SECRET" => aws_ssm_parameter.curve_secret[role].value
      if contains(nonsensitive(keys(var.curve_secret_keys)), role)
    },
  )
}

resource "aws_cloudwatch_log_group" "function" {
  # checkov:skip=CKV_AWS_338:Retention is the log_retention_days variable (30 days by default): function debug output of training runs, not an audit trail.
  name              = "/aws/lambda/${local.function_name}"
  retention_in_days = var.log_retention_days
  kms_key_id        = aws_kms_key.this.arn
  tags              = local.tags
}

resource "aws_lambda_function" "tensor" {
  # checkov:skip=CKV_AWS_116:Invoked synchronously only; a dead-letter queue applies to asynchronous invocations, and the graph server relaunches failed calls itself.
  # checkov:skip=CKV_AWS_272:Code signing needs an AWS Signer profile; the zip is built reproducibly by `dorylus package-lambda` and pinned here by its sha256 (source_code_hash).
  function_name                  = local.function_name
  description                    = "Dorylus ${var.name}: tensor tasks (ApplyVertex and its backward)"
  role                           = aws_iam_role.function.arn
  filename                       = var.function_zip
  source_code_hash               = filebase64sha256(var.function_zip)
  handler                        = "lambdas.handler.handler"
  runtime                        = "python${var.function_python}"
  architectures                  = [var.function_architecture]
  memory_size                    = var.function_memory_mb
  timeout                        = var.function_timeout_s
  reserved_concurrent_executions = var.function_reserved_concurrency
  kms_key_arn                    = aws_kms_key.this.arn

  environment {
    variables = merge({
      DORYLUS_CLUSTER    = var.name
      DORYLUS_SSM_PREFIX = local.ssm_prefix
    }, local.function_curve_env)
  }

  vpc_config {
    subnet_ids         = [aws_subnet.private.id]
    security_group_ids = [aws_security_group.function.id]
  }

  tracing_config {
    mode = "PassThrough"
  }

  logging_config {
    log_format = "Text"
    log_group  = aws_cloudwatch_log_group.function.name
  }

  tags = local.tags

  # The reservations first, so that the function's interfaces never take a server's address.
  depends_on = [
    aws_iam_role_policy.function,
    aws_ec2_subnet_cidr_reservation.param_servers,
    aws_ec2_subnet_cidr_reservation.graph_servers,
  ]
}
