# CURVE key pairs by role (`dorylus keys`), as SecureString parameters encrypted with the
# cluster's key: /<name>/curve/<role>/public and /<name>/curve/<role>/secret. The servers read
# all of them at start; the function only its own pair and the public keys.

resource "aws_ssm_parameter" "curve_public" {
  for_each    = var.curve_public_keys
  name        = "${local.ssm_prefix}/curve/${each.key}/public"
  description = "Dorylus ${var.name}: CURVE public key of ${each.key}"
  type        = "SecureString"
  key_id      = aws_kms_key.this.arn
  value       = each.value
  tags        = local.tags
}

resource "aws_ssm_parameter" "curve_secret" {
  for_each    = nonsensitive(toset(keys(var.curve_secret_keys)))
  name        = "${local.ssm_prefix}/curve/${each.key}/secret"
  description = "Dorylus ${var.name}: CURVE secret key of ${each.key}"
  type        = "SecureString"
  key_id      = aws_kms_key.this.arn
  value       = var.curve_secret_keys[each.key]
  tags        = local.tags

  lifecycle {
    precondition {
      condition     = contains(keys(var.curve_public_keys), each.key)
      error_message = "Every role in curve_secret_keys needs its public key in curve_public_keys."
    }
  }
}
