# Graph servers and parameter servers: EC2 in the private subnet at fixed addresses, no public
# IP, IMDSv2 only, encrypted root volumes. User data installs the project and runs the role as a
# systemd service from /etc/dorylus/cluster.json (see user_data.sh.tftpl).

data "aws_ec2_instance_type" "graph" {
  instance_type = var.graph_server_instance_type
}

data "aws_ec2_instance_type" "param" {
  instance_type = var.param_server_instance_type
}

data "aws_ssm_parameter" "al2023" {
  for_each = toset(["x86_64", "arm64"])
  name     = "/aws/service/ami-amazon-linux-latest/al2023-ami-kernel-default-${each.key}"
}

locals {
  ami = {
    graph = coalesce(var.ami_id, data.aws_ssm_parameter.al2023[contains(data.aws_ec2_instance_type.graph.supported_architectures, "arm64") ? "arm64" : "x86_64"].value)
    param = coalesce(var.ami_id, data.aws_ssm_parameter.al2023[contains(data.aws_ec2_instance_type.param.supported_architectures, "arm64") ? "arm64" : "x86_64"].value)
  }

  user_data_common = {
    cluster_json    = jsonencode(local.cluster)
    train_json      = jsonencode(var.train_config)
    region          = local.region
    wheel_uri       = "s3://${var.bucket_name}/${local.wheel_key}"
    wheel_name      = basename(var.dorylus_wheel)
    torch_pip_spec  = var.torch_pip_spec
    torch_index_url = var.torch_index_url
  }
}

resource "aws_placement_group" "servers" {
  count    = var.placement_group ? 1 : 0
  name     = "${var.name}-servers"
  strategy = "cluster"
  tags     = local.tags
}

resource "aws_instance" "param_server" {
  # checkov:skip=CKV_AWS_126:Detailed (1-minute) monitoring is the detailed_monitoring variable, off by default: it is billed per instance and basic monitoring suffices for a training job.
  count                       = var.param_server_count
  ami                         = local.ami.param
  instance_type               = var.param_server_instance_type
  subnet_id                   = aws_subnet.private.id
  private_ip                  = local.param_server_ips[count.index]
  associate_public_ip_address = false
  vpc_security_group_ids      = [aws_security_group.servers.id]
  iam_instance_profile        = aws_iam_instance_profile.server.name
  key_name                    = var.key_name
  placement_group             = var.placement_group ? aws_placement_group.servers[0].id : null
  ebs_optimized               = true
  monitoring                  = var.detailed_monitoring
  user_data                   = templatefile("${path.module}/user_data.sh.tftpl", merge(local.user_data_common, { role = "paramserver", index = count.index }))
  user_data_replace_on_change = true

  metadata_options {
    http_endpoint               = "enabled"
    http_tokens                 = "required"
    http_put_response_hop_limit = 1
  }

  root_block_device {
    volume_type = "gp3"
    volume_size = var.root_volume_gb
    encrypted   = true
  }

  tags = merge(local.tags, { Name = "${var.name}-paramserver-${count.index}", "dorylus:role" = "paramserver" })

  lifecycle {
    ignore_changes = [ami] # a newer Amazon Linux image must not replace a running cluster
  }

  depends_on = [
    aws_s3_object.dorylus_wheel,
    aws_route.private_nat,
    aws_vpc_endpoint.s3,
    aws_iam_role_policy.server,
    aws_ec2_subnet_cidr_reservation.param_servers,
    aws_ec2_subnet_cidr_reservation.graph_servers,
  ]
}

resource "aws_instance" "graph_server" {
  # checkov:skip=CKV_AWS_126:Detailed (1-minute) monitoring is the detailed_monitoring variable, off by default: it is billed per instance and basic monitoring suffices for a training job.
  count                       = var.graph_server_count
  ami                         = local.ami.graph
  instance_type               = var.graph_server_instance_type
  subnet_id                   = aws_subnet.private.id
  private_ip                  = local.graph_server_ips[count.index]
  associate_public_ip_address = false
  vpc_security_group_ids      = [aws_security_group.servers.id]
  iam_instance_profile        = aws_iam_instance_profile.server.name
  key_name                    = var.key_name
  placement_group             = var.placement_group ? aws_placement_group.servers[0].id : null
  ebs_optimized               = true
  monitoring                  = var.detailed_monitoring
  user_data                   = templatefile("${path.module}/user_data.sh.tftpl", merge(local.user_data_common, { role = "graphserver", index = count.index }))
  user_data_replace_on_change = true

  dynamic "instance_market_options" {
    for_each = var.graph_server_spot ? [1] : []
    content {
      market_type = "spot"
      spot_options {
        spot_instance_type             = "one-time"
        instance_interruption_behavior = "terminate"
      }
    }
  }

  metadata_options {
    http_endpoint               = "enabled"
    http_tokens                 = "required"
    http_put_response_hop_limit = 1
  }

  root_block_device {
    volume_type = "gp3"
    volume_size = var.root_volume_gb
    encrypted   = true
  }

  tags = merge(local.tags, { Name = "${var.name}-graphserver-${count.index}", "dorylus:role" = "graphserver" })

  lifecycle {
    ignore_changes = [ami] # a newer Amazon Linux image must not replace a running cluster
  }

  depends_on = [
    aws_s3_object.dorylus_wheel,
    aws_route.private_nat,
    aws_vpc_endpoint.s3,
    aws_iam_role_policy.server,
    aws_ec2_subnet_cidr_reservation.param_servers,
    aws_ec2_subnet_cidr_reservation.graph_servers,
  ]
}
