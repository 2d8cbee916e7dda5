# Example: Cora on 2 graph servers + 1 parameter server in us-east-1.
# Build the two artifacts first, from the repository root:
#   dorylus package-lambda --out dist/dorylus-function.zip --python 3.12 --arch x86_64
#   pip wheel --no-deps -w dist .
# Then, in terraform/examples:  terraform init && terraform apply -var-file=example.tfvars
#
# What it costs while it exists (on-demand list prices, us-east-1, as of 2025; see README):
#   2 x c5.2xlarge graph servers        2 x $0.34/h               $0.680/h
#   1 x c5.xlarge parameter server      $0.17/h                   $0.170/h
#   NAT gateway                         $0.045/h (+ $0.045/GB)    $0.045/h
#   its public IPv4 address             $0.005/h                  $0.005/h
#   3 x 50 GB gp3 root volumes          $0.08/GB-month            $0.016/h
#   KMS key                             $1/month                  $0.001/h
#   total while idle                                              about $0.92/h ($22/day)
#   plus the function while it runs: 2 GB x $0.0000166667/GB-s = $0.12/h per busy function,
#   and $0.20 per million calls.
# `terraform destroy -var-file=example.tfvars` when done.

region      = "us-east-1"
name        = "dorylus-demo"
bucket_name = "change-me-dorylus-demo-partitions" # pick your own: bucket names are global

store_prefix         = "stores/cora-2"
force_destroy_bucket = true # a demo: let `terraform destroy` delete the uploaded partitions too

graph_server_count         = 2
graph_server_instance_type = "c5.2xlarge"
graph_server_market        = "on-demand" # "spot": well under half the price, AWS may reclaim them (spot.tfvars)
param_server_count         = 1
param_server_instance_type = "c5.xlarge"

function_zip                  = "../../dist/dorylus-function.zip"
function_python               = "3.12"
function_architecture         = "x86_64"
function_memory_mb            = 2048
function_timeout_s            = 300
function_reserved_concurrency = -1 # reserve (and cap) e.g. 100 if the account has spare concurrency

dorylus_wheel = "../../dist/dorylus-0.1.0-py3-none-any.whl"

# Passed to the servers as /etc/dorylus/train.json (`dorylus train --config` keys).
train_config = {
  model  = "gcn"
  layers = 2
  hidden = 16
}

ssh_cidr_blocks = [] # no SSH: use `aws ssm start-session --target <instance id>`

# CURVE keys from `dorylus keys` (when it exists); left empty here. Secrets are better passed as
# TF_VAR_curve_secret_keys in the environment than written in a file.
curve_public_keys = {}
curve_secret_keys = {}
