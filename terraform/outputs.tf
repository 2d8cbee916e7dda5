# `terraform output -json cluster > cluster.json` writes the cluster file that the servers hold
# as /etc/dorylus/cluster.json and that `dorylus train --cluster` reads (shape: main.tf, README).

output "cluster" {
  description = "The cluster file (format dorylus-cluster/1): store URL, function, parameter and graph servers."
  value       = local.cluster
}

output "store_url" {
  description = "Where to upload the partition store: dorylus upload DIR <store_url>."
  value       = local.store_url
}

output "function_name" {
  description = "Name of the tensor function."
  value       = aws_lambda_function.tensor.function_name
}

output "instances" {
  description = "EC2 instance ids by role, e.g. for `aws ssm start-session --target ID`. Spot graph servers come and go: their groups are in graph_server_groups."
  value = {
    param_servers = aws_instance.param_server[*].id
    graph_servers = aws_instance.graph_server[*].id
  }
}

output "graph_server_groups" {
  description = "Spot only: the Auto Scaling group of each graph server, by part (empty on-demand). `aws autoscaling describe-auto-scaling-groups --auto-scaling-group-names NAME` names its current instance."
  value       = aws_autoscaling_group.graph_server[*].name
}

output "spot_events_log_group" {
  description = "Spot only: the log group of interruption notices and graph-server terminations (null on-demand)."
  value       = one(aws_cloudwatch_log_group.spot_events[*].name)
}

output "coordinator_instance_id" {
  description = "Run `dorylus train --cluster /etc/dorylus/cluster.json` here (the first parameter server)."
  value       = aws_instance.param_server[0].id
}

output "kms_key_arn" {
  description = "The cluster's KMS key (bucket, parameters, logs); uploaders need kms:GenerateDataKey on it."
  value       = aws_kms_key.this.arn
}
