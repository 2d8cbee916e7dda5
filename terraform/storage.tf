# The bucket for partition stores (under store_prefix) and the project wheel (under deploy/):
# private, encrypted with the cluster's KMS key, versioned, reachable only over TLS.

resource "aws_s3_bucket" "this" {
  # checkov:skip=CKV_AWS_18:Access logging needs a second bucket and costs per request; the objects are training data re-creatable with `dorylus partition` + `dorylus upload`, and CloudTrail data events can be enabled account-wide where required.
  # checkov:skip=CKV_AWS_144:Cross-region replication doubles storage for data that is re-creatable from the dataset; the cluster lives in one region.
  # checkov:skip=CKV2_AWS_62:No consumer of object events: the servers read the store when they start.
  bucket        = var.bucket_name
  force_destroy = var.force_destroy_bucket
  tags          = local.tags
}

resource "aws_s3_bucket_ownership_controls" "this" {
  bucket = aws_s3_bucket.this.id
  rule {
    object_ownership = "BucketOwnerEnforced"
  }
}

resource "aws_s3_bucket_public_access_block" "this" {
  bucket                  = aws_s3_bucket.this.id
  block_public_acls       = true
  block_public_policy     = true
  ignore_public_acls      = true
  restrict_public_buckets = true
}

resource "aws_s3_bucket_server_side_encryption_configuration" "this" {
  bucket = aws_s3_bucket.this.id
  rule {
    apply_server_side_encryption_by_default {
      sse_algorithm     = "aws:kms"
      kms_master_key_id = aws_kms_key.this.arn
    }
    bucket_key_enabled = true
  }
}

resource "aws_s3_bucket_versioning" "this" {
  bucket = aws_s3_bucket.this.id
  versioning_configuration {
    status = "Enabled"
  }
}

resource "aws_s3_bucket_lifecycle_configuration" "this" {
  bucket = aws_s3_bucket.this.id

  rule {
    id     = "old-versions-and-failed-uploads"
    status = "Enabled"
    filter {}
    noncurrent_version_expiration {
      noncurrent_days = 30
    }
    abort_incomplete_multipart_upload {
      days_after_initiation = 7
    }
  }

  depends_on = [aws_s3_bucket_versioning.this]
}

data "aws_iam_policy_document" "bucket" {
  statement {
    sid       = "DenyInsecureTransport"
    effect    = "Deny"
    actions   = ["s3:*"]
    resources = [aws_s3_bucket.this.arn, "${aws_s3_bucket.this.arn}/*"]
    principals {
      type        = "*"
      identifiers = ["*"]
    }
    condition {
      test     = "Bool"
      variable = "aws:SecureTransport"
      values   = ["false"]
    }
  }
}

resource "aws_s3_bucket_policy" "this" {
  bucket     = aws_s3_bucket.this.id
  policy     = data.aws_iam_policy_document.bucket.json
  depends_on = [aws_s3_bucket_public_access_block.this]
}

# The project wheel the servers install at boot.
resource "aws_s3_object" "dorylus_wheel" {
  bucket      = aws_s3_bucket.this.id
  key         = local.wheel_key
  source      = var.dorylus_wheel
  source_hash = filemd5(var.dorylus_wheel)
  kms_key_id  = aws_kms_key.this.arn
  tags        = local.tags

  depends_on = [aws_s3_bucket_server_side_encryption_configuration.this, aws_s3_bucket_policy.this]
}
