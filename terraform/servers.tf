# Graph servers and parameter servers: EC2 in the private subnet at fixed addresses, no public
# IP, IMDSv2 only, encrypted root volumes. User data installs the project and runs the role as a
# systemd service from /etc/dorylus/cluster.json (see user_data.sh.tftpl).
#
# graph_server_market = "on-demand" (the default): one aws_instance per graph server.
# graph_server_market = "spot": one Auto Scaling group of exactly one spot instance per graph
# server, from a launch template that pins the part's fixed address on the primary interface.
# One group per part, not one group for all: the cluster file names each part's host, so a
# replacement must come back at the same address, and a launch template can pin an address only
# for a group of one. The parameter servers stay on-demand: the first hosts the coordinator.

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

  graph_spot = var.graph_server_market == "spot"
  # The instance metadata service the watcher (dorylus/spot.py) polls for an interruption or a
  # termination notice; "off" where no notice can come (on-demand instances).
  spot_watch = { graph = local.graph_spot ? "http://169.254.169.254" : "off", param = "off" }
  # Spot pools the capacity-optimized allocation may choose among (one zone: one pool per type).
  graph_spot_types = distinct(concat([var.graph_server_instance_type], var.graph_server_spot_types))
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
  user_data                   = templatefile("${path.module}/user_data.sh.tftpl", merge(local.user_data_common, { role = "paramserver", index = count.index, spot_watch = local.spot_watch.param }))
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
  count                       = local.graph_spot ? 0 : var.graph_server_count
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
  user_data                   = templatefile("${path.module}/user_data.sh.tftpl", merge(local.user_data_common, { role = "graphserver", index = count.index, spot_watch = local.spot_watch.graph }))
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

# ----------------------------------------------------------------------------- spot graph servers

resource "aws_launch_template" "graph_server" {
  count                  = local.graph_spot ? var.graph_server_count : 0
  name                   = "${var.name}-graphserver-${count.index}"
  description            = "Dorylus ${var.name}: graph server ${count.index} (spot, fixed address)"
  image_id               = local.ami.graph
  instance_type          = var.graph_server_instance_type
  key_name               = var.key_name
  ebs_optimized          = true
  update_default_version = true
  user_data              = base64encode(templatefile("${path.module}/user_data.sh.tftpl", merge(local.user_data_common, { role = "graphserver", index = count.index, spot_watch = local.spot_watch.graph })))

  iam_instance_profile {
    name = aws_iam_instance_profile.server.name
  }

  # The part's fixed address: a replacement comes back where the cluster file says it is.
  # (The group gives the subnet; security groups belong on the interface once one is named.)
  network_interfaces {
    device_index                = 0
    private_ip_address          = local.graph_server_ips[count.index]
    associate_public_ip_address = false
    delete_on_termination       = true
    security_groups             = [aws_security_group.servers.id]
  }

  monitoring {
    enabled = var.detailed_monitoring
  }

  metadata_options {
    http_endpoint               = "enabled"
    http_tokens                 = "required"
    http_put_response_hop_limit = 1
  }

  block_device_mappings {
    device_name = "/dev/xvda" # Amazon Linux 2023's root device (ami_id must keep it)
    ebs {
      volume_type           = "gp3"
      volume_size           = var.root_volume_gb
      encrypted             = true
      delete_on_termination = true
    }
  }

  tag_specifications {
    resource_type = "volume"
    tags          = merge(local.tags, { Name = "${var.name}-graphserver-${count.index}" })
  }

  tags = local.tags

  lifecycle {
    ignore_changes = [image_id] # a newer Amazon Linux image must not replace a running cluster
  }
}

resource "aws_autoscaling_group" "graph_server" {
  count               = local.graph_spot ? var.graph_server_count : 0
  name                = "${var.name}-graphserver-${count.index}"
  min_size            = 1
  max_size            = 1
  desired_capacity    = 1
  vpc_zone_identifier = [aws_subnet.private.id]
  placement_group     = var.placement_group ? aws_placement_group.servers[0].id : null
  health_check_type   = "EC2"
  # Capacity rebalancing launches the replacement *before* the at-risk instance goes; with the
  # part's address pinned, that launch can only fail (the address is in use) until the old
  # instance is gone, so it would add failed launches and nothing else. The rebalance
  # recommendation still reaches the watcher on the instance (IMDS) and the event log
  # (interruptions.tf), and the coordinator checkpoints on it.
  capacity_rebalance        = false
  wait_for_capacity_timeout = "15m"

  mixed_instances_policy {
    instances_distribution {
      on_demand_base_capacity                  = 0
      on_demand_percentage_above_base_capacity = 0
      # The pools least likely to be interrupted, not the cheapest: an interruption costs the
      # whole cluster half a checkpoint interval plus a replacement's boot.
      spot_allocation_strategy = "capacity-optimized"
    }

    launch_template {
      launch_template_specification {
        launch_template_id = aws_launch_template.graph_server[count.index].id
        version            = aws_launch_template.graph_server[count.index].latest_version
      }

      dynamic "override" {
        for_each = local.graph_spot_types
        content {
          instance_type = override.value
        }
      }
    }
  }

  # A graph server the group terminates keeps running this long after it is told (IMDS
  # autoscaling/target-lifecycle-state, which the watcher polls), so the coordinator can
  # checkpoint; then the termination goes ahead. Nothing completes the action early: that would
  # need autoscaling:CompleteLifecycleAction on the servers' role for a saving of seconds.
  initial_lifecycle_hook {
    name                 = "checkpoint-before-terminating"
    lifecycle_transition = "autoscaling:EC2_INSTANCE_TERMINATING"
    heartbeat_timeout    = var.graph_server_termination_grace_s
    default_result       = "CONTINUE"
  }

  dynamic "tag" {
    for_each = merge(local.tags, { Name = "${var.name}-graphserver-${count.index}", "dorylus:role" = "graphserver", "dorylus:part" = tostring(count.index) })
    content {
      key                 = tag.key
      value               = tag.value
      propagate_at_launch = true
    }
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
