# Who may talk to whom. The ZeroMQ ports open only to the function's security group and to the
# servers' own group (graph servers exchange ghost rows and pull weights; the coordinator runs on
# a parameter server). The function accepts nothing: it dials out. No rule admits 0.0.0.0/0;
# SSH exists only when ssh_cidr_blocks names networks.

resource "aws_security_group" "servers" {
  name        = "${var.name}-servers"
  description = "Dorylus graph and parameter servers"
  vpc_id      = aws_vpc.this.id
  tags        = merge(local.tags, { Name = "${var.name}-servers" })
}

resource "aws_security_group" "function" {
  name        = "${var.name}-function"
  description = "Dorylus tensor function (Lambda): outbound only"
  vpc_id      = aws_vpc.this.id
  tags        = merge(local.tags, { Name = "${var.name}-function" })
}

locals {
  # (port, description) of each ZeroMQ listener
  zmq_ports = {
    graph = { port = var.graph_server_port, what = "graph server ZeroMQ" }
    param = { port = var.param_server_port, what = "parameter server ZeroMQ" }
  }
}

resource "aws_vpc_security_group_ingress_rule" "zmq_from_function" {
  for_each                     = local.zmq_ports
  security_group_id            = aws_security_group.servers.id
  referenced_security_group_id = aws_security_group.function.id
  ip_protocol                  = "tcp"
  from_port                    = each.value.port
  to_port                      = each.value.port
  description                  = "${each.value.what} from the tensor function"
}

resource "aws_vpc_security_group_ingress_rule" "zmq_from_servers" {
  for_each                     = local.zmq_ports
  security_group_id            = aws_security_group.servers.id
  referenced_security_group_id = aws_security_group.servers.id
  ip_protocol                  = "tcp"
  from_port                    = each.value.port
  to_port                      = each.value.port
  description                  = "${each.value.what} from the other servers and the coordinator"
}

resource "aws_vpc_security_group_ingress_rule" "ssh" {
  for_each          = toset(var.ssh_cidr_blocks)
  security_group_id = aws_security_group.servers.id
  cidr_ipv4         = each.value
  ip_protocol       = "tcp"
  from_port         = 22
  to_port           = 22
  description       = "SSH from an operator network"
}

resource "aws_vpc_security_group_egress_rule" "servers_zmq" {
  for_each                     = local.zmq_ports
  security_group_id            = aws_security_group.servers.id
  referenced_security_group_id = aws_security_group.servers.id
  ip_protocol                  = "tcp"
  from_port                    = each.value.port
  to_port                      = each.value.port
  description                  = "${each.value.what} to the other servers"
}

resource "aws_vpc_security_group_egress_rule" "servers_https" {
  security_group_id = aws_security_group.servers.id
  cidr_ipv4         = "0.0.0.0/0"
  ip_protocol       = "tcp"
  from_port         = 443
  to_port           = 443
  description       = "HTTPS: packages at boot, the Lambda, SSM and S3 APIs (S3 through the gateway endpoint)"
}

resource "aws_vpc_security_group_egress_rule" "function_zmq" {
  for_each                     = local.zmq_ports
  security_group_id            = aws_security_group.function.id
  referenced_security_group_id = aws_security_group.servers.id
  ip_protocol                  = "tcp"
  from_port                    = each.value.port
  to_port                      = each.value.port
  description                  = "${each.value.what}: the function dials its servers"
}

resource "aws_vpc_security_group_egress_rule" "function_https" {
  security_group_id = aws_security_group.function.id
  cidr_ipv4         = "0.0.0.0/0"
  ip_protocol       = "tcp"
  from_port         = 443
  to_port           = 443
  description       = "HTTPS to the SSM API (the function's CURVE keys)"
}
