# One VPC: a private subnet for the servers and the function, a public subnet holding only the
# NAT gateway (package installs at boot, and the Lambda and SSM APIs), and an S3 gateway endpoint
# so that partition downloads bypass the NAT gateway and its per-GB charge.

# The servers' zone: availability_zone, or the first zone (by name) that offers every server
# instance type. (A few zones cannot hold Lambda VPC interfaces, e.g. use1-az3: name another.)
data "aws_ec2_instance_type_offerings" "servers" {
  location_type = "availability-zone"
  filter {
    name   = "instance-type"
    values = local.server_types
  }
}

locals {
  server_types = distinct([var.graph_server_instance_type, var.param_server_instance_type])
  offering     = data.aws_ec2_instance_type_offerings.servers
  zones_offering_all = sort([
    for zone in distinct(local.offering.locations) : zone
    if length(distinct([for i, type in local.offering.instance_types : type if local.offering.locations[i] == zone])) == length(local.server_types)
  ])
  availability_zone = var.availability_zone != null ? var.availability_zone : try(local.zones_offering_all[0], null)
}

resource "aws_vpc" "this" {
  cidr_block           = var.vpc_cidr
  enable_dns_support   = true
  enable_dns_hostnames = true
  tags                 = merge(local.tags, { Name = var.name })
}

# Lock down the default security group: nothing uses it, nothing may.
resource "aws_default_security_group" "this" {
  vpc_id = aws_vpc.this.id
  tags   = merge(local.tags, { Name = "${var.name}-default-unused" })
}

resource "aws_subnet" "private" {
  vpc_id                  = aws_vpc.this.id
  cidr_block              = cidrsubnet(var.vpc_cidr, 24 - tonumber(split("/", var.vpc_cidr)[1]), 1)
  availability_zone       = local.availability_zone
  map_public_ip_on_launch = false
  tags                    = merge(local.tags, { Name = "${var.name}-private" })

  lifecycle {
    precondition {
      condition     = local.availability_zone != null
      error_message = "No availability zone of this region offers both server instance types; set availability_zone or other types."
    }
  }
}

# Addresses only the servers may use: AWS assigns nothing from an explicit reservation.
resource "aws_ec2_subnet_cidr_reservation" "param_servers" {
  subnet_id        = aws_subnet.private.id
  cidr_block       = local.param_server_block
  reservation_type = "explicit"
  description      = "Dorylus parameter servers"
}

resource "aws_ec2_subnet_cidr_reservation" "graph_servers" {
  subnet_id        = aws_subnet.private.id
  cidr_block       = local.graph_server_block
  reservation_type = "explicit"
  description      = "Dorylus graph servers"
}

resource "aws_subnet" "public" {
  vpc_id                  = aws_vpc.this.id
  cidr_block              = cidrsubnet(var.vpc_cidr, 24 - tonumber(split("/", var.vpc_cidr)[1]), 0)
  availability_zone       = local.availability_zone
  map_public_ip_on_launch = false
  tags                    = merge(local.tags, { Name = "${var.name}-public-nat-only" })
}

resource "aws_internet_gateway" "this" {
  vpc_id = aws_vpc.this.id
  tags   = merge(local.tags, { Name = var.name })
}

resource "aws_eip" "nat" {
  domain     = "vpc"
  tags       = merge(local.tags, { Name = "${var.name}-nat" })
  depends_on = [aws_internet_gateway.this]
}

resource "aws_nat_gateway" "this" {
  allocation_id = aws_eip.nat.id
  subnet_id     = aws_subnet.public.id
  tags          = merge(local.tags, { Name = var.name })
}

resource "aws_route_table" "public" {
  vpc_id = aws_vpc.this.id
  tags   = merge(local.tags, { Name = "${var.name}-public" })
}

resource "aws_route" "public_internet" {
  route_table_id         = aws_route_table.public.id
  destination_cidr_block = "0.0.0.0/0"
  gateway_id             = aws_internet_gateway.this.id
}

resource "aws_route_table_association" "public" {
  subnet_id      = aws_subnet.public.id
  route_table_id = aws_route_table.public.id
}

resource "aws_route_table" "private" {
  vpc_id = aws_vpc.this.id
  tags   = merge(local.tags, { Name = "${var.name}-private" })
}

resource "aws_route" "private_nat" {
  route_table_id         = aws_route_table.private.id
  destination_cidr_block = "0.0.0.0/0"
  nat_gateway_id         = aws_nat_gateway.this.id
}

resource "aws_route_table_association" "private" {
  subnet_id      = aws_subnet.private.id
  route_table_id = aws_route_table.private.id
}

resource "aws_vpc_endpoint" "s3" {
  vpc_id            = aws_vpc.this.id
  service_name      = "com.amazonaws.${local.region}.s3"
  vpc_endpoint_type = "Gateway"
  route_table_ids   = [aws_route_table.private.id]
  tags              = merge(local.tags, { Name = "${var.name}-s3" })
}

# Flow logs of rejected traffic only: what the security groups turned away, at little cost.
resource "aws_cloudwatch_log_group" "flow" {
  # checkov:skip=CKV_AWS_338:Retention is the log_retention_days variable (30 days by default): a training cluster's rejected-traffic log, not an audit trail.
  name              = "/dorylus/${var.name}/vpc-flow-rejected"
  retention_in_days = var.log_retention_days
  kms_key_id        = aws_kms_key.this.arn
  tags              = local.tags
}

data "aws_iam_policy_document" "flow_assume" {
  statement {
    actions = ["sts:AssumeRole"]
    principals {
      type        = "Service"
      identifiers = ["vpc-flow-logs.amazonaws.com"]
    }
    condition {
      test     = "StringEquals"
      variable = "aws:SourceAccount"
      values   = [local.account]
    }
  }
}

data "aws_iam_policy_document" "flow" {
  statement {
    actions   = ["logs:CreateLogStream", "logs:PutLogEvents", "logs:DescribeLogStreams"]
    resources = ["${aws_cloudwatch_log_group.flow.arn}:*"]
  }
}

resource "aws_iam_role" "flow" {
  name               = "${var.name}-vpc-flow-logs"
  assume_role_policy = data.aws_iam_policy_document.flow_assume.json
  tags               = local.tags
}

resource "aws_iam_role_policy" "flow" {
  name   = "write-flow-log-group"
  role   = aws_iam_role.flow.id
  policy = data.aws_iam_policy_document.flow.json
}

resource "aws_flow_log" "this" {
  vpc_id          = aws_vpc.this.id
  traffic_type    = "REJECT"
  log_destination = aws_cloudwatch_log_group.flow.arn
  iam_role_arn    = aws_iam_role.flow.arn
  tags            = local.tags
}
