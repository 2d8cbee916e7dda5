# The example's graph servers on spot instances, on top of example.tfvars:
#   terraform apply -var-file=example.tfvars -var-file=spot.tfvars
# Each graph server is a spot instance in its own Auto Scaling group of one, which launches a
# replacement at the same address after an interruption; the server's watcher tells the
# coordinator, which checkpoints at once (docs/aws.md, "Spot graph servers"). The parameter
# server stays on-demand: it hosts the coordinator.
# `checkov -d terraform/ --var-file terraform/examples/spot.tfvars` checks the module this way.

graph_server_market = "spot"
# More spot pools for the capacity-optimized allocation: the same size, other families. All must
# be offered in the servers' zone; the training config must suit every one of them.
graph_server_spot_types = ["c5n.2xlarge", "c6i.2xlarge", "m5.2xlarge"]
