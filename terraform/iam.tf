# Least privilege. The function: its VPC network interfaces, its own log group, decrypting its
# environment (which holds its CURVE keys; it reads nothing from SSM).
# The servers: read the partition prefix and the project wheel, this cluster's SSM parameters,
# invoke this cluster's function, and (optionally) Session Manager. No "*" action anywhere; a
# "*" resource only for Describe/Session-Manager actions that AWS cannot scope to a resource.

# ----------------------------------------------------------------------------- function

data "aws_iam_policy_document" "function_assume" {
  statement {
    actions = ["sts:AssumeRole"]
    principals {
      type        = "Service"
      identifiers = ["lambda.amazonaws.com"]
    }
    condition {
      test     = "StringEquals"
      variable = "aws:SourceAccount"
      values   = [local.account]
    }
  }
}

data "aws_iam_policy_document" "function" {
  statement {
    sid       = "OwnLogGroup"
    actions   = ["logs:CreateLogStream", "logs:PutLogEvents"]
    resources = ["${aws_cloudwatch_log_group.function.arn}:*"]
  }

  statement {
    sid     = "VpcNetworkInterfacesInTheClusterSubnet"
    actions = ["ec2:CreateNetworkInterface"]
    resources = [
      "arn:${local.arn_prefix}:ec2:${local.region}:${local.account}:network-interface/*",
      aws_subnet.private.arn,
      aws_security_group.function.arn,
    ]
  }

  statement {
    sid       = "VpcNetworkInterfacesOfTheClusterVpc"
    actions   = ["ec2:DeleteNetworkInterface", "ec2:AssignPrivateIpAddresses", "ec2:UnassignPrivateIpAddresses"]
    resources = ["arn:${local.arn_prefix}:ec2:${local.region}:${local.account}:network-interface/*"]
    condition {
      test     = "ArnEquals"
      variable = "ec2:Vpc"
      values   = [aws_vpc.this.arn]
    }
  }

  statement {
    sid       = "DescribeHasNoResourceLevelPermissions"
    actions   = ["ec2:DescribeNetworkInterfaces", "ec2:DescribeSubnets"]
    resources = ["*"]
  }

  statement {
    sid       = "DecryptEnvironment" # its CURVE keys arrive in the KMS-encrypted environment (function.tf)
    actions   = ["kms:Decrypt"]
    resources = [aws_kms_key.this.arn]
  }
}

resource "aws_iam_role" "function" {
  name               = "${var.name}-function"
  assume_role_policy = data.aws_iam_policy_document.function_assume.json
  tags               = local.tags
}

resource "aws_iam_role_policy" "function" {
  name   = "dorylus-function"
  role   = aws_iam_role.function.id
  policy = data.aws_iam_policy_document.function.json
}

# ----------------------------------------------------------------------------- servers

data "aws_iam_policy_document" "server_assume" {
  statement {
    actions = ["sts:AssumeRole"]
    principals {
      type        = "Service"
      identifiers = ["ec2.amazonaws.com"]
    }
  }
}

data "aws_iam_policy_document" "server" {
  statement {
    sid       = "ListThePartitionPrefix"
    actions   = ["s3:ListBucket"]
    resources = [aws_s3_bucket.this.arn]
    condition {
      test     = "StringLike"
      variable = "s3:prefix"
      values   = [var.store_prefix, "${var.store_prefix}/*"]
    }
  }

  statement {
    sid     = "ReadThePartitionsAndTheWheel"
    actions = ["s3:GetObject"]
    resources = [
      "${aws_s3_bucket.this.arn}/${var.store_prefix}/*",
      "${aws_s3_bucket.this.arn}/${local.wheel_key}",
    ]
  }

  statement {
    sid     = "ThisClustersParameters"
    actions = ["ssm:GetParameter", "ssm:GetParameters", "ssm:GetParametersByPath"]
    resources = [
      "arn:${local.arn_prefix}:ssm:${local.region}:${local.account}:parameter${local.ssm_prefix}",
      "arn:${local.arn_prefix}:ssm:${local.region}:${local.account}:parameter${local.ssm_prefix}/*",
    ]
  }

  statement {
    sid       = "DecryptObjectsAndParameters"
    actions   = ["kms:Decrypt"]
    resources = [aws_kms_key.this.arn]
  }

  statement {
    sid       = "InvokeTheFunction"
    actions   = ["lambda:InvokeFunction"]
    resources = [aws_lambda_function.tensor.arn, "${aws_lambda_function.tensor.arn}:*"]
  }

  dynamic "statement" {
    for_each = var.session_manager ? [1] : []
    content {
      sid       = "SessionManagerRegistration"
      actions   = ["ssm:UpdateInstanceInformation"]
      resources = ["arn:${local.arn_prefix}:ec2:${local.region}:${local.account}:instance/*"]
    }
  }

  dynamic "statement" {
    for_each = var.session_manager ? [1] : []
    content {
      sid = "SessionManagerChannelsHaveNoResourceLevelPermissions"
      actions = [
        "ssmmessages:CreateControlChannel", "ssmmessages:CreateDataChannel",
        "ssmmessages:OpenControlChannel", "ssmmessages:OpenDataChannel",
      ]
      resources = ["*"]
    }
  }
}

resource "aws_iam_role" "server" {
  name               = "${var.name}-server"
  assume_role_policy = data.aws_iam_policy_document.server_assume.json
  tags               = local.tags
}

resource "aws_iam_role_policy" "server" {
  name   = "dorylus-server"
  role   = aws_iam_role.server.id
  policy = data.aws_iam_policy_document.server.json
}

resource "aws_iam_instance_profile" "server" {
  name = "${var.name}-server"
  role = aws_iam_role.server.name
  tags = local.tags
}
