"""The checkpoint and data bucket: private, encrypted, versioned, TLS only (rules 11-15)."""

from __future__ import annotations

from dataclasses import dataclass

import pulumi
import pulumi_aws as aws


@dataclass(frozen=True)
class StorageArgs:
    cluster_name: str
    bucket_prefix: str
    encryption: str  # "kms" (a key of this stack) | "s3" (S3-managed AES256)
    noncurrent_version_days: int
    abort_multipart_days: int


class Storage(pulumi.ComponentResource):
    """Bucket + ownership, public-access block, versioning, SSE, lifecycle, TLS-only policy."""

    def __init__(self, name: str, args: StorageArgs,
                 opts: pulumi.ResourceOptions | None = None):
        super().__init__("rayfleet:infra:Storage", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)

        self.kms_key: aws.kms.Key | None = None
        if args.encryption == "kms":
            # A key of the stack's own: access to data needs both the bucket and the key, and
            # CloudTrail records every decrypt. The default key policy delegates to IAM, whose
            # node-role policies grant use only through S3 (kms:ViaService).
            self.kms_key = aws.kms.Key(
                f"{name}-key",
                description=f"rayfleet {args.cluster_name}: checkpoint and data bucket",
                enable_key_rotation=True,
                deletion_window_in_days=30,
                opts=child,
            )

        self.bucket = aws.s3.Bucket(
            f"{name}-bucket",
            bucket_prefix=args.bucket_prefix,
            # Checkpoints are the one thing a `pulumi destroy` must not take silently.
            force_destroy=False,
            tags={"Name": f"{args.cluster_name}-data"},
            opts=child,
        )
        bucket_id = self.bucket.id

        # ACLs disabled: the bucket owner owns every object and only policies grant access
        # (rule 15, S3.12).
        ownership = aws.s3.BucketOwnershipControls(
            f"{name}-ownership",
            bucket=bucket_id,
            rule=aws.s3.BucketOwnershipControlsRuleArgs(object_ownership="BucketOwnerEnforced"),
            opts=child,
        )
        public_block = aws.s3.BucketPublicAccessBlock(
            f"{name}-public-access-block",
            bucket=bucket_id,
            block_public_acls=True,
            block_public_policy=True,
            ignore_public_acls=True,
            restrict_public_buckets=True,
            opts=child,
        )
        versioning = aws.s3.BucketVersioning(
            f"{name}-versioning",
            bucket=bucket_id,
            versioning_configuration=aws.s3.BucketVersioningVersioningConfigurationArgs(
                status="Enabled"),
            opts=child,
        )
        sse_default = (aws.s3.
                       BucketServerSideEncryptionConfigurationRuleApplyServerSideEncryptionByDefaultArgs)
        if self.kms_key is not None:
            default = sse_default(sse_algorithm="aws:kms", kms_master_key_id=self.kms_key.arn)
        else:
            default = sse_default(sse_algorithm="AES256")
        aws.s3.BucketServerSideEncryptionConfiguration(
            f"{name}-encryption",
            bucket=bucket_id,
            rules=[aws.s3.BucketServerSideEncryptionConfigurationRuleArgs(
                apply_server_side_encryption_by_default=default,
                # One data key per bucket instead of one KMS call per object: checkpoints are
                # many objects, and KMS requests are billed and rate limited.
                bucket_key_enabled=self.kms_key is not None,
            )],
            opts=child,
        )

        every_object = aws.s3.BucketLifecycleConfigurationRuleFilterArgs(prefix="")
        aws.s3.BucketLifecycleConfiguration(
            f"{name}-lifecycle",
            bucket=bucket_id,
            rules=[
                # Versioning keeps an overwritten checkpoint recoverable for a while, not
                # forever.
                aws.s3.BucketLifecycleConfigurationRuleArgs(
                    id="expire-noncurrent-versions",
                    status="Enabled",
                    filter=every_object,
                    noncurrent_version_expiration=aws.s3
                    .BucketLifecycleConfigurationRuleNoncurrentVersionExpirationArgs(
                        noncurrent_days=args.noncurrent_version_days),
                ),
                # A checkpoint upload killed midway leaves parts that bill until aborted.
                aws.s3.BucketLifecycleConfigurationRuleArgs(
                    id="abort-incomplete-multipart-uploads",
                    status="Enabled",
                    filter=every_object,
                    abort_incomplete_multipart_upload=aws.s3
                    .BucketLifecycleConfigurationRuleAbortIncompleteMultipartUploadArgs(
                        days_after_initiation=args.abort_multipart_days),
                ),
                aws.s3.BucketLifecycleConfigurationRuleArgs(
                    id="remove-expired-delete-markers",
                    status="Enabled",
                    filter=every_object,
                    expiration=aws.s3.BucketLifecycleConfigurationRuleExpirationArgs(
                        expired_object_delete_marker=True),
                ),
            ],
            # AWS: lifecycle rules on noncurrent versions need versioning to exist first.
            opts=pulumi.ResourceOptions(parent=self, depends_on=[versioning]),
        )

        objects = pulumi.Output.concat(self.bucket.arn, "/*")
        aws.s3.BucketPolicy(
            f"{name}-policy",
            bucket=bucket_id,
            policy=pulumi.Output.json_dumps({
                "Version": "2012-10-17",
                "Statement": [
                    {
                        # Rule 13 (S3.5): nothing reaches the bucket over plain HTTP.
                        "Sid": "DenyInsecureTransport",
                        "Effect": "Deny",
                        "Principal": "*",
                        "Action": "s3:*",
                        "Resource": [self.bucket.arn, objects],
                        "Condition": {"Bool": {"aws:SecureTransport": "false"}},
                    },
                    {
                        "Sid": "DenyOutdatedTls",
                        "Effect": "Deny",
                        "Principal": "*",
                        "Action": "s3:*",
                        "Resource": [self.bucket.arn, objects],
                        "Condition": {"NumericLessThan": {"s3:TlsVersion": "1.2"}},
                    },
                ],
            }),
            # S3 rejects a bucket policy while ownership/public-access settings are in flux.
            opts=pulumi.ResourceOptions(parent=self, depends_on=[ownership, public_block]),
        )

        self.kms_key_arn = self.kms_key.arn if self.kms_key is not None else None
        self.register_outputs({
            "bucket": self.bucket.bucket,
            "bucket_arn": self.bucket.arn,
            "kms_key_arn": self.kms_key_arn,
        })
