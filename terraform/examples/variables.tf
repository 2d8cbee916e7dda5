# The example's inputs: the module's (see ../variables.tf for what each means) plus the region.

variable "region" {
  description = "AWS region of the cluster."
  type        = string
  default     = "us-east-1"
}

variable "name" {
  type    = string
  default = "dorylus"
}

variable "bucket_name" {
  type = string
}

variable "store_prefix" {
  type    = string
  default = "stores/default"
}

variable "force_destroy_bucket" {
  type    = bool
  default = false
}

variable "graph_server_count" {
  type    = number
  default = 2
}

variable "graph_server_instance_type" {
  type    = string
  default = "c5.2xlarge"
}

variable "graph_server_market" {
  type    = string
  default = "on-demand"
}

variable "graph_server_spot_types" {
  type    = list(string)
  default = []
}

variable "param_server_count" {
  type    = number
  default = 1
}

variable "param_server_instance_type" {
  type    = string
  default = "c5.xlarge"
}

variable "function_zip" {
  type = string
}

variable "function_python" {
  type    = string
  default = "3.12"
}

variable "function_architecture" {
  type    = string
  default = "x86_64"
}

variable "function_memory_mb" {
  type    = number
  default = 2048
}

variable "function_timeout_s" {
  type    = number
  default = 300
}

variable "function_reserved_concurrency" {
  type    = number
  default = -1
}

variable "dorylus_wheel" {
  type = string
}

variable "train_config" {
  type    = any
  default = {}
}

variable "ssh_cidr_blocks" {
  type    = list(string)
  default = []
}

variable "curve_public_keys" {
  type    = map(string)
  default = {}
}

variable "curve_secret_keys" {
  type      = map(string)
  default   = {}
  sensitive = true
}
