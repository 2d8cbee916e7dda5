# Example root module: one Dorylus cluster from ../ with the values in example.tfvars.
#   terraform init && terraform apply -var-file=example.tfvars
#   terraform output -json cluster > cluster.json

terraform {
  required_version = ">= 1.6"

  required_providers {
    aws = {
      source  = "hashicorp/aws"
      version = ">= 5.40, < 7.0"
    }
  }
}

provider "aws" {
  region = var.region

  default_tags {
    tags = { "dorylus:example" = "true" }
  }
}

module "dorylus" {
  source = "../"

  name                          = var.name
  bucket_name                   = var.bucket_name
  store_prefix                  = var.store_prefix
  force_destroy_bucket          = var.force_destroy_bucket
  graph_server_count            = var.graph_server_count
  graph_server_instance_type    = var.graph_server_instance_type
  graph_server_market           = var.graph_server_market
  graph_server_spot_types       = var.graph_server_spot_types
  param_server_count            = var.param_server_count
  param_server_instance_type    = var.param_server_instance_type
  function_zip                  = var.function_zip
  function_python               = var.function_python
  function_architecture         = var.function_architecture
  function_memory_mb            = var.function_memory_mb
  function_timeout_s            = var.function_timeout_s
  function_reserved_concurrency = var.function_reserved_concurrency
  dorylus_wheel                 = var.dorylus_wheel
  train_config                  = var.train_config
  ssh_cidr_blocks               = var.ssh_cidr_blocks
  curve_public_keys             = var.curve_public_keys
  curve_secret_keys             = var.curve_secret_keys
}

output "cluster" {
  description = "The cluster file for `dorylus train --cluster` (also /etc/dorylus/cluster.json on the servers)."
  value       = module.dorylus.cluster
}

output "store_url" {
  description = "dorylus upload DIR <store_url>"
  value       = module.dorylus.store_url
}

output "coordinator_instance_id" {
  description = "aws ssm start-session --target <id>, then run the coordinator there."
  value       = module.dorylus.coordinator_instance_id
}

output "graph_server_groups" {
  description = "Spot: each graph server's Auto Scaling group."
  value       = module.dorylus.graph_server_groups
}

output "spot_events_log_group" {
  description = "Spot: the log of interruption notices and graph-server terminations."
  value       = module.dorylus.spot_events_log_group
}

output "instances" {
  description = "EC2 instance ids by role."
  value       = module.dorylus.instances
}
