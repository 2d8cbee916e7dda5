# Dorylus on AWS: graph servers and parameter servers on EC2 in one private subnet, the tensor
# function in AWS Lambda in the same subnet (same AZ: no cross-AZ data charges, lowest latency),
# partitions in an S3 bucket reached through a gateway endpoint, CURVE keys in SSM.
# One customer-managed KMS key encrypts the bucket, the parameters, the logs and the function's
# environment.

data "aws_region" "current" {}
data "aws_caller_identity" "current" {}
data "aws_partition" "current" {}

locals {
  region     = data.aws_region.current.name
  account    = data.aws_caller_identity.current.account_id
  arn_prefix = data.aws_partition.current.partition
  ssm_prefix = "/${var.name}"

  function_name = "${var.name}-tensor"
  wheel_key     = "deploy/${basename(var.dorylus_wheel)}"
  store_url     = "s3://${var.bucket_name}/${var.store_prefix}"

  # Fixed private addresses, so that every server's user data can name all the others without a
  # dependency cycle: parameter servers in .8/29, graph servers in .64/26 of the private /24.
  # Both blocks are reserved in the subnet (network.tf), so Lambda's interfaces never take them.
  param_server_block = cidrsubnet(aws_subnet.private.cidr_block, 5, 1)
  graph_server_block = cidrsubnet(aws_subnet.private.cidr_block, 2, 1)
  param_server_ips   = [for i in range(var.param_server_count) : cidrhost(local.param_server_block, i)]
  graph_server_ips   = [for i in range(var.graph_server_count) : cidrhost(local.graph_server_block, i)]

  # The cluster file: written to /etc/dorylus/cluster.json on every server and given as the
  # `cluster` output, so `terraform output -json cluster > cluster.json` is what
  # `dorylus train --cluster cluster.json` reads. Shape (format dorylus-cluster/1):
  #   {"format": "dorylus-cluster/1", "name": str, "region": str,
  #    "store": "s3://BUCKET/PREFIX", "bucket": str, "ssm_prefix": "/NAME",
  #    "function": {"name": str, "arn": str, "python": "3.12", "architecture": "x86_64",
  #                 "memory_mb": int, "timeout_s": int},
  #    "param_servers": [{"index": 0, "host": "10.42.1.8", "port": 5600}, ...],
  #    "graph_servers": [{"part": 0, "host": "10.42.1.64", "port": 5500}, ...],
  #    "curve": {"roles": [str, ...], "parameters": "/NAME/curve/<role>/{public,secret}"}}
  # Hosts are private VPC addresses: run the coordinator inside the VPC (on the first parameter
  # server, reached through Session Manager).
  cluster = {
    format     = "dorylus-cluster/1"
    name       = var.name
    region     = local.region
    store      = local.store_url
    bucket     = var.bucket_name
    ssm_prefix = local.ssm_prefix
    function = {
      name         = local.function_name
      arn          = "arn:${local.arn_prefix}:lambda:${local.region}:${local.account}:function:${local.function_name}"
      python       = var.function_python
      architecture = var.function_architecture
      memory_mb    = var.function_memory_mb
      timeout_s    = var.function_timeout_s
    }
    param_servers = [for i, ip in local.param_server_ips : { index = i, host = ip, port = var.param_server_port }]
    graph_servers = [for i, ip in local.graph_server_ips : { part = i, host = ip, port = var.graph_server_port }]
    curve = {
      roles      = sort(keys(var.curve_public_keys))
      parameters = "${local.ssm_prefix}/curve/<role>/{public,secret}"
    }
  }

  tags = merge({ "dorylus:cluster" = var.name }, var.tags)
}

# ----------------------------------------------------------------------------- encryption key

data "aws_iam_policy_document" "kms" {
  # checkov:skip=CKV_AWS_109:A key policy's Resource "*" means this key only; the account-root statement is AWS's default key policy and keeps the key manageable (and deletable) through IAM.
  # checkov:skip=CKV_AWS_111:Same statement as above: key policies grant on the key itself.
  # checkov:skip=CKV_AWS_356:Same statement as above: "*" in a key policy is this key, not every resource.
  statement {
    sid       = "AccountAdministers"
    actions   = ["kms:*"]
    resources = ["*"]
    principals {
      type        = "AWS"
      identifiers = ["arn:${local.arn_prefix}:iam::${local.account}:root"]
    }
  }

  statement {
    sid       = "CloudWatchLogsEncryptsThisClustersLogGroups"
    actions   = ["kms:Encrypt", "kms:Decrypt", "kms:ReEncrypt*", "kms:GenerateDataKey*", "kms:Describe*"]
    resources = ["*"]
    principals {
      type        = "Service"
      identifiers = ["logs.${local.region}.amazonaws.com"]
    }
    condition {
      test     = "ArnLike"
      variable = "kms:EncryptionContext:aws:logs:arn"
      values = [
        "arn:${local.arn_prefix}:logs:${local.region}:${local.account}:log-group:/aws/lambda/${local.function_name}",
        "arn:${local.arn_prefix}:logs:${local.region}:${local.account}:log-group:/dorylus/${var.name}/*",
      ]
    }
  }
}

resource "aws_kms_key" "this" {
  description             = "Dorylus ${var.name}: partitions, CURVE keys, logs"
  enable_key_rotation     = true
  deletion_window_in_days = 7
  policy                  = data.aws_iam_policy_document.kms.json
  tags                    = local.tags
}

resource "aws_kms_alias" "this" {
  name          = "alias/${var.name}"
  target_key_id = aws_kms_key.this.key_id
}
