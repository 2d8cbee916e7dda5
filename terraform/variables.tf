# Inputs of the Dorylus module. Everything has a safe default except what only the operator can
# know: the bucket name (globally unique) and the two build artifacts (the function zip from
# `dorylus package-lambda`, the project wheel from `pip wheel --no-deps -w dist .`).

variable "name" {
  description = "Name of this cluster; prefixes every resource, the function and the SSM parameters."
  type        = string
  default     = "dorylus"

  validation {
    condition     = can(regex("^[a-z][a-z0-9-]{0,30}$", var.name))
    error_message = "name must be 1-31 lowercase letters, digits or hyphens, starting with a letter."
  }
}

variable "tags" {
  description = "Tags added to every resource."
  type        = map(string)
  default     = {}
}

# ----------------------------------------------------------------------------- network

variable "vpc_cidr" {
  description = "CIDR of the cluster's VPC. The servers get fixed addresses in its private subnet."
  type        = string
  default     = "10.42.0.0/16"

  validation {
    condition     = can(cidrhost(var.vpc_cidr, 0)) && tonumber(split("/", var.vpc_cidr)[1]) <= 23
    error_message = "vpc_cidr must be an IPv4 CIDR of /23 or larger (it holds two /24 subnets)."
  }
}

variable "availability_zone" {
  description = "Zone of the servers and the function. Null: the first zone (by name) offering both server instance types."
  type        = string
  default     = null
}

variable "ssh_cidr_blocks" {
  description = "CIDRs allowed to reach the servers on port 22 (through a VPN or peering: the servers have no public address). Empty (the default) opens no SSH at all; use Session Manager instead."
  type        = list(string)
  default     = []

  validation {
    condition     = alltrue([for c in var.ssh_cidr_blocks : can(cidrhost(c, 0)) && !contains(["0.0.0.0/0", "::/0"], c)])
    error_message = "ssh_cidr_blocks must be valid CIDRs and never the whole internet."
  }
}

variable "key_name" {
  description = "EC2 key pair for SSH (only useful with ssh_cidr_blocks). Null: no key."
  type        = string
  default     = null
}

variable "session_manager" {
  description = "Let the servers register with SSM Session Manager, the way to get a shell on them without SSH."
  type        = bool
  default     = true
}

# ----------------------------------------------------------------------------- servers

variable "graph_server_count" {
  description = "Number of graph servers, one per partition of the store."
  type        = number
  default     = 2

  validation {
    condition     = var.graph_server_count >= 1 && var.graph_server_count <= 64 && floor(var.graph_server_count) == var.graph_server_count
    error_message = "graph_server_count must be a whole number from 1 to 64."
  }
}

variable "graph_server_instance_type" {
  description = "EC2 instance type of the graph servers."
  type        = string
  default     = "c5.2xlarge"
}

variable "graph_server_market" {
  description = "\"on-demand\" (the default): one EC2 instance per graph server. \"spot\": each graph server is a spot instance in its own Auto Scaling group of one, which brings a replacement back at the same address after an interruption; a watcher on the instance tells the coordinator, which checkpoints at once (see docs/aws.md)."
  type        = string
  default     = "on-demand"

  validation {
    condition     = contains(["on-demand", "spot"], var.graph_server_market)
    error_message = "graph_server_market must be \"on-demand\" or \"spot\"."
  }
}

variable "graph_server_spot_types" {
  description = "Spot only: further instance types a graph server may run as, beside graph_server_instance_type (more spot pools for the capacity-optimized allocation). Each must be offered in the servers' zone and hold a partition; the cluster's training config must suit all of them."
  type        = list(string)
  default     = []

  validation {
    condition     = length(var.graph_server_spot_types) <= 19 && alltrue([for t in var.graph_server_spot_types : can(regex("^[a-z][a-z0-9-]*\\.[a-z0-9]+$", t))])
    error_message = "graph_server_spot_types must be at most 19 instance type names such as \"c5n.2xlarge\" (an Auto Scaling group takes 20 types in all)."
  }
}

variable "graph_server_termination_grace_s" {
  description = "Spot only: how long a graph server the Auto Scaling group terminates (rebalancing, a health replacement, an instance refresh) keeps running after it is told, so that the coordinator can checkpoint (the lifecycle hook's heartbeat timeout). A spot interruption itself always gives two minutes."
  type        = number
  default     = 180

  validation {
    condition     = var.graph_server_termination_grace_s >= 30 && var.graph_server_termination_grace_s <= 7200 && floor(var.graph_server_termination_grace_s) == var.graph_server_termination_grace_s
    error_message = "graph_server_termination_grace_s must be a whole number of seconds from 30 to 7200 (the lifecycle hook's limits)."
  }
}

variable "param_server_count" {
  description = "Number of parameter servers. The first also hosts the coordinator (`dorylus train --cluster`)."
  type        = number
  default     = 1

  validation {
    condition     = var.param_server_count >= 1 && var.param_server_count <= 8 && floor(var.param_server_count) == var.param_server_count
    error_message = "param_server_count must be a whole number from 1 to 8."
  }
}

variable "param_server_instance_type" {
  description = "EC2 instance type of the parameter servers."
  type        = string
  default     = "c5.xlarge"
}

variable "graph_server_port" {
  description = "ZeroMQ port the graph servers listen on."
  type        = number
  default     = 5500
}

variable "param_server_port" {
  description = "ZeroMQ port the parameter servers listen on."
  type        = number
  default     = 5600
}

variable "ami_id" {
  description = "AMI for the servers. Null: the latest Amazon Linux 2023 for the instance type's architecture (the user data expects dnf and the AWS CLI)."
  type        = string
  default     = null
}

variable "root_volume_gb" {
  description = "Root volume size of each server (the project, torch, and the partition cache)."
  type        = number
  default     = 50
}

variable "placement_group" {
  description = "Put the servers in a cluster placement group (lowest latency between them; needs an instance type that supports it, e.g. not t3)."
  type        = bool
  default     = true
}

variable "detailed_monitoring" {
  description = "1-minute CloudWatch metrics for the servers (billed per instance)."
  type        = bool
  default     = false
}

variable "dorylus_wheel" {
  description = "Path to the project's wheel (`pip wheel --no-deps -w dist .`); uploaded to the bucket and installed on the servers."
  type        = string
}

variable "torch_pip_spec" {
  description = "The torch requirement the servers install before the project."
  type        = string
  default     = "torch==2.13.0"
}

variable "torch_index_url" {
  description = "Package index for torch: the CPU-only builds by default (PyPI's Linux wheels are the CUDA builds)."
  type        = string
  default     = "https://download.pytorch.org/whl/cpu"
}

variable "train_config" {
  description = "Training config the servers start with (the keys of `dorylus train --config`, as an object); written to /etc/dorylus/train.json."
  type        = any
  default     = {}
}

# ----------------------------------------------------------------------------- function

variable "function_zip" {
  description = "Path to the function bundle built by `dorylus package-lambda` (with --python and --arch matching the two variables below)."
  type        = string
}

variable "function_python" {
  description = "The function's Python runtime version (`dorylus package-lambda --python`)."
  type        = string
  default     = "3.12"

  validation {
    condition     = contains(["3.10", "3.11", "3.12", "3.13", "3.14"], var.function_python)
    error_message = "function_python must be a Python version Lambda runs: 3.10 to 3.14."
  }
}

variable "function_architecture" {
  description = "The function's architecture (`dorylus package-lambda --arch`)."
  type        = string
  default     = "x86_64"

  validation {
    condition     = contains(["x86_64", "arm64"], var.function_architecture)
    error_message = "function_architecture must be x86_64 or arm64."
  }
}

variable "function_memory_mb" {
  description = "Function memory in MB (Lambda gives CPU in proportion: one vCPU at 1769 MB)."
  type        = number
  default     = 2048

  validation {
    condition     = var.function_memory_mb >= 128 && var.function_memory_mb <= 10240
    error_message = "function_memory_mb must be from 128 to 10240."
  }
}

variable "function_timeout_s" {
  description = "Function timeout in seconds; `task_timeout_s` of the training config must not exceed it."
  type        = number
  default     = 300

  validation {
    condition     = var.function_timeout_s >= 1 && var.function_timeout_s <= 900
    error_message = "function_timeout_s must be from 1 to 900 (Lambda's limit)."
  }
}

variable "function_reserved_concurrency" {
  description = "Concurrent executions reserved for (and capping) the function; -1 reserves none. Reserving needs that much spare account concurrency (new accounts have little)."
  type        = number
  default     = -1

  validation {
    condition     = var.function_reserved_concurrency >= -1
    error_message = "function_reserved_concurrency must be -1 (none) or a count."
  }
}

variable "log_retention_days" {
  description = "Retention of the function's and the VPC flow logs' CloudWatch log groups."
  type        = number
  default     = 30
}

# ----------------------------------------------------------------------------- storage and keys

variable "bucket_name" {
  description = "Name of the S3 bucket for partitions and the project wheel (globally unique)."
  type        = string

  validation {
    condition     = can(regex("^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$", var.bucket_name))
    error_message = "bucket_name must be a valid S3 bucket name: 3-63 lowercase letters, digits, dots or hyphens."
  }
}

variable "store_prefix" {
  description = "Prefix of the partition store in the bucket (`dorylus upload DIR s3://BUCKET/PREFIX`); the servers may read only under it."
  type        = string
  default     = "stores/default"

  validation {
    condition     = can(regex("^[A-Za-z0-9._-]+(/[A-Za-z0-9._-]+)*$", var.store_prefix)) && !startswith(var.store_prefix, "deploy")
    error_message = "store_prefix must be a relative key prefix without leading or trailing slashes, outside deploy/."
  }
}

variable "force_destroy_bucket" {
  description = "Let `terraform destroy` delete the bucket with its objects (and their old versions)."
  type        = bool
  default     = false
}

variable "curve_public_keys" {
  description = "CURVE public keys (Z85, 40 characters) by role: coordinator, graphserver, paramserver, function (`dorylus keys --out DIR` writes DIR/curve.tfvars.json). Stored as SSM SecureString parameters under /<name>/curve/<role>/public; the function's environment gets its own and the servers'."
  type        = map(string)
  default     = {}

  validation {
    condition     = alltrue([for k in values(var.curve_public_keys) : length(k) == 40])
    error_message = "Each CURVE public key must be 40 Z85 characters."
  }

  validation {
    condition     = alltrue([for role in keys(var.curve_public_keys) : contains(["coordinator", "graphserver", "paramserver", "function"], role)])
    error_message = "CURVE roles are coordinator, graphserver, paramserver and function (the names `dorylus keys` uses)."
  }
}

variable "curve_secret_keys" {
  description = "CURVE secret keys by role, the same roles as curve_public_keys. They end up in the Terraform state too: keep the state encrypted and private."
  type        = map(string)
  default     = {}
  sensitive   = true

  validation {
    condition     = alltrue([for k in values(var.curve_secret_keys) : length(k) == 40])
    error_message = "Each CURVE secret key must be 40 Z85 characters."
  }
}
