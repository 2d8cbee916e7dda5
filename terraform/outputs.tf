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
  description = "EC2 instance ids by role, e.g. for `aws ssm start-session --target ID`."
  value = {
    param_servers = aws_instance.param_server[*].id
    graph_servers = aws_instance.graph_server[*].id
  }
}

output "coordinator_instance_id" {
  description = "Run `dorylus train --cluster /etc/dorylus/cluster.json` here (the first parameter server)."
  value       = aws_instance.param_server[0].id
}

output "kms_key_arn" {
  description = "The cluster's KMS key (bucket, parameters, logs); uploaders need kms:GenerateDataKey on it."
  value       = aws_kms_key.this.arn
}
