# Spot only: a record of every interruption notice and every termination of a graph server, in
# one CloudWatch log group, through EventBridge.
#
# The run itself does not depend on it: each graph server's watcher (dorylus/spot.py) reads the
# same notices from the instance metadata service and tells the coordinator, which checkpoints
# at once. The log is what is left to the operator afterwards: which part was taken back and
# when, and how often (the interruption rate `dorylus plan --spot-interruptions-per-hour` asks
# for). A log group is the smallest sound target: the module already keeps its logs in
# CloudWatch under /dorylus/<name>/, encrypted with the cluster's key, whose policy already
# admits that prefix (main.tf); it needs no subscriber, no new service and no role, only the
# resource policy below. (An SNS topic would also need a key-policy statement for EventBridge and
# a subscription someone confirms; a Lambda would be a second function to build and secure.)

resource "aws_cloudwatch_log_group" "spot_events" {
  # checkov:skip=CKV_AWS_338:Retention is the log_retention_days variable (30 days by default): a record of a training cluster's interruptions, not an audit trail.
  count             = local.graph_spot ? 1 : 0
  name              = "/dorylus/${var.name}/spot-events"
  retention_in_days = var.log_retention_days
  kms_key_id        = aws_kms_key.this.arn
  tags              = local.tags
}

# EC2 sends these for spot instances of the whole account and region: the events carry the
# instance id but none of its tags, so no pattern can keep only this cluster's. The termination
# rule below names this cluster's groups; join the two on the instance id.
resource "aws_cloudwatch_event_rule" "spot_interruption" {
  count       = local.graph_spot ? 1 : 0
  name        = "${var.name}-spot-interruption"
  description = "Dorylus ${var.name}: spot interruption warnings and rebalance recommendations (account-wide: EC2 events carry no tags)"
  event_pattern = jsonencode({
    source      = ["aws.ec2"]
    detail-type = ["EC2 Spot Instance Interruption Warning", "EC2 Instance Rebalance Recommendation"]
  })
  tags = local.tags
}

# The lifecycle hook's event: one of this cluster's graph-server groups is terminating an
# instance (and giving it graph_server_termination_grace_s to checkpoint).
resource "aws_cloudwatch_event_rule" "graph_server_terminating" {
  count       = local.graph_spot ? 1 : 0
  name        = "${var.name}-graphserver-terminating"
  description = "Dorylus ${var.name}: a graph server's Auto Scaling group is terminating its instance"
  event_pattern = jsonencode({
    source      = ["aws.autoscaling"]
    detail-type = ["EC2 Instance-terminate Lifecycle Action"]
    detail = {
      AutoScalingGroupName = aws_autoscaling_group.graph_server[*].name
    }
  })
  tags = local.tags
}

resource "aws_cloudwatch_event_target" "spot_interruption" {
  count = local.graph_spot ? 1 : 0
  rule  = aws_cloudwatch_event_rule.spot_interruption[0].name
  arn   = aws_cloudwatch_log_group.spot_events[0].arn
}

resource "aws_cloudwatch_event_target" "graph_server_terminating" {
  count = local.graph_spot ? 1 : 0
  rule  = aws_cloudwatch_event_rule.graph_server_terminating[0].name
  arn   = aws_cloudwatch_log_group.spot_events[0].arn
}

# EventBridge writes to a log group through the group's resource policy (no role): streams in
# this group only, and events only from the two rules above.
data "aws_iam_policy_document" "spot_events" {
  count = local.graph_spot ? 1 : 0

  statement {
    sid       = "EventBridgeCreatesStreamsInThisGroup"
    actions   = ["logs:CreateLogStream"]
    resources = ["${aws_cloudwatch_log_group.spot_events[0].arn}:*"]
    principals {
      type        = "Service"
      identifiers = ["events.amazonaws.com", "delivery.logs.amazonaws.com"]
    }
  }

  statement {
    sid       = "EventBridgeWritesTheTwoRulesEvents"
    actions   = ["logs:PutLogEvents"]
    resources = ["${aws_cloudwatch_log_group.spot_events[0].arn}:*:*"]
    principals {
      type        = "Service"
      identifiers = ["events.amazonaws.com", "delivery.logs.amazonaws.com"]
    }
    condition {
      test     = "ArnEquals"
      variable = "aws:SourceArn"
      values   = [aws_cloudwatch_event_rule.spot_interruption[0].arn, aws_cloudwatch_event_rule.graph_server_terminating[0].arn]
    }
  }
}

resource "aws_cloudwatch_log_resource_policy" "spot_events" {
  count           = local.graph_spot ? 1 : 0
  policy_name     = "${var.name}-spot-events"
  policy_document = data.aws_iam_policy_document.spot_events[0].json
}
