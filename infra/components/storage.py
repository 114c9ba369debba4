"""The checkpoint and data bucket: private, encrypted, versioned, TLS only (rules 11-15); its
access logged to a log bucket hardened the same way (rule 27); its KMS key with a key policy
of its own (rule 29)."""

from __future__ import annotations

from dataclasses import dataclass

import pulumi
import pulumi_aws as aws

from rayfleet.facts import BUCKET_PREFIX_MAX

# Where S3 server access logs of the data bucket land in the log bucket.
ACCESS_LOG_PREFIX = "s3-access/"
# The log bucket's name: the data bucket's prefix, cut to leave room for this.
LOG_SUFFIX = "log-"
# KMS permissions that administer a key without using it (encrypt/decrypt are left out).
KEY_ADMIN_ACTIONS = ["kms:Create*", "kms:Describe*", "kms:Enable*", "kms:List*", "kms:Put*",
                     "kms:Update*", "kms:Revoke*", "kms:Disable*", "kms:Get*", "kms:Delete*",
                     "kms:TagResource", "kms:UntagResource", "kms:ScheduleKeyDeletion",
                     "kms:CancelKeyDeletion"]


def key_admin_statement(partition: str, account: pulumi.Input[str]) -> dict:
    """The account administers the key through IAM; using it needs a statement of its own.
    Without an explicit policy AWS's default grants the account kms:* (rule 29)."""
    return {
        "Sid": "AdministerThroughIam",
        "Effect": "Allow",
        "Principal": {"AWS": pulumi.Output.concat(f"arn:{partition}:iam::", account, ":root")},
        "Action": KEY_ADMIN_ACTIONS,
        "Resource": "*",
    }


def stack_key(resource_name: str, description: str, partition: str,
              account: pulumi.Input[str], use: dict, opts: pulumi.ResourceOptions) -> aws.kms.Key:
    """A rotated KMS key of the stack with an explicit policy: the account administers it
    through IAM, and `use` says who may use it for what (rule 29)."""
    return aws.kms.Key(
        resource_name,
        description=description,
        enable_key_rotation=True,
        deletion_window_in_days=30,
        policy=pulumi.Output.json_dumps({
            "Version": "2012-10-17",
            "Statement": [key_admin_statement(partition, account), use],
        }),
        opts=opts,
    )


def sse_default(**kwargs):
    """A bucket's default encryption (``sse_algorithm``, ``kms_master_key_id``)."""
    return (aws.s3.
            BucketServerSideEncryptionConfigurationRuleApplyServerSideEncryptionByDefaultArgs(
                **kwargs))


def lifecycle_rules(noncurrent_days: int, abort_days: int, expire_days: int | None = None
                    ) -> list[aws.s3.BucketLifecycleConfigurationRuleArgs]:
    """A bucket's lifecycle: old versions, abandoned uploads and stray delete markers go, and
    with ``expire_days`` every object after that many days."""
    every_object = aws.s3.BucketLifecycleConfigurationRuleFilterArgs(prefix="")
    rules = [
        # Versioning keeps an overwritten checkpoint recoverable for a while, not
        # forever.
        aws.s3.BucketLifecycleConfigurationRuleArgs(
            id="expire-noncurrent-versions",
            status="Enabled",
            filter=every_object,
            noncurrent_version_expiration=aws.s3
            .BucketLifecycleConfigurationRuleNoncurrentVersionExpirationArgs(
                noncurrent_days=noncurrent_days),
        ),
        # A checkpoint upload killed midway leaves parts that bill until aborted.
        aws.s3.BucketLifecycleConfigurationRuleArgs(
            id="abort-incomplete-multipart-uploads",
            status="Enabled",
            filter=every_object,
            abort_incomplete_multipart_upload=aws.s3
            .BucketLifecycleConfigurationRuleAbortIncompleteMultipartUploadArgs(
                days_after_initiation=abort_days),
        ),
        aws.s3.BucketLifecycleConfigurationRuleArgs(
            id="remove-expired-delete-markers",
            status="Enabled",
            filter=every_object,
            expiration=aws.s3.BucketLifecycleConfigurationRuleExpirationArgs(
                expired_object_delete_marker=True),
        ),
    ]
    if expire_days is not None:
        rules.append(aws.s3.BucketLifecycleConfigurationRuleArgs(
            id="expire-after-retention",
            status="Enabled",
            filter=every_object,
            expiration=aws.s3.BucketLifecycleConfigurationRuleExpirationArgs(
                days=expire_days),
        ))
    return rules


def tls_only_policy(bucket: aws.s3.Bucket, allow: list[dict] | None) -> pulumi.Output[str]:
    """A bucket policy denying plain HTTP and TLS before 1.2, granting ``allow`` besides."""
    objects = pulumi.Output.concat(bucket.arn, "/*")
    return pulumi.Output.json_dumps({
        "Version": "2012-10-17",
        "Statement": [
            {
                # Rule 13 (S3.5): nothing reaches the bucket over plain HTTP.
                "Sid": "DenyInsecureTransport",
                "Effect": "Deny",
                "Principal": "*",
                "Action": "s3:*",
                "Resource": [bucket.arn, objects],
                "Condition": {"Bool": {"aws:SecureTransport": "false"}},
            },
            {
                "Sid": "DenyOutdatedTls",
                "Effect": "Deny",
                "Principal": "*",
                "Action": "s3:*",
                "Resource": [bucket.arn, objects],
                "Condition": {"NumericLessThan": {"s3:TlsVersion": "1.2"}},
            },
            *(allow or []),
        ],
    })


@dataclass(frozen=True)
class StorageArgs:
    cluster_name: str
    region: str
    partition: str
    bucket_prefix: str
    encryption: str  # "kms" (a key of this stack) | "s3" (S3-managed AES256)
    noncurrent_version_days: int
    abort_multipart_days: int
    access_log_days: int = 365  # how long the log bucket keeps access logs


class Storage(pulumi.ComponentResource):
    """Bucket + ownership, public-access block, versioning, SSE, lifecycle, TLS-only policy."""

    def __init__(self, name: str, args: StorageArgs,
                 opts: pulumi.ResourceOptions | None = None):
        super().__init__("rayfleet:infra:Storage", name, None, opts)
        account = aws.get_caller_identity(opts=pulumi.InvokeOptions(parent=self)).account_id
        self.kms_key = self._key(name, args, account)
        self.bucket = self._data_bucket(name, args)
        self.log_bucket, log_policy = self._log_bucket(name, args, account)
        aws.s3.BucketLogging(
            f"{name}-access-logging",
            bucket=self.bucket.id,
            target_bucket=self.log_bucket.id,
            target_prefix=ACCESS_LOG_PREFIX,
            # S3 checks the target's policy when logging is turned on.
            opts=pulumi.ResourceOptions(parent=self, depends_on=[log_policy]),
        )

        self.kms_key_arn = self.kms_key.arn if self.kms_key is not None else None
        self.register_outputs({
            "bucket": self.bucket.bucket,
            "bucket_arn": self.bucket.arn,
            "kms_key_arn": self.kms_key_arn,
            "access_log_bucket": self.log_bucket.bucket,
        })

    def _key(self, name: str, args: StorageArgs,
             account: pulumi.Input[str]) -> aws.kms.Key | None:
        """The data bucket's KMS key with rayfleet:bucketEncryption kms, else None."""
        if args.encryption != "kms":
            return None
        # A key of the stack's own: access to data needs both the bucket and the key, and
        # CloudTrail records every decrypt. Its policy lets the account administer it and
        # use it only through S3 in this region; the node roles' IAM policies then say
        # which roles may (rule 29).
        return stack_key(
            f"{name}-key", f"rayfleet {args.cluster_name}: checkpoint and data bucket",
            args.partition, account, {
                "Sid": "UseOnlyThroughS3",
                "Effect": "Allow",
                "Principal": {"AWS": pulumi.Output.concat(
                    f"arn:{args.partition}:iam::", account, ":root")},
                "Action": ["kms:Decrypt", "kms:GenerateDataKey", "kms:Encrypt",
                           "kms:ReEncrypt*", "kms:DescribeKey"],
                "Resource": "*",
                "Condition": {"StringEquals": {
                    "kms:ViaService": f"s3.{args.region}.amazonaws.com",
                    "kms:CallerAccount": account}},
            }, pulumi.ResourceOptions(parent=self))

    def _data_bucket(self, name: str, args: StorageArgs) -> aws.s3.Bucket:
        """The checkpoint and data bucket, hardened, encrypted with the stack's key if any."""
        bucket = aws.s3.Bucket(
            f"{name}-bucket",
            bucket_prefix=args.bucket_prefix,
            # Checkpoints are the one thing a `pulumi destroy` must not take silently.
            force_destroy=False,
            tags={"Name": f"{args.cluster_name}-data"},
            opts=pulumi.ResourceOptions(parent=self),
        )
        if self.kms_key is not None:
            default = sse_default(sse_algorithm="aws:kms", kms_master_key_id=self.kms_key.arn)
        else:
            default = sse_default(sse_algorithm="AES256")
        self._harden(name, bucket, default, args.noncurrent_version_days,
                     args.abort_multipart_days)
        return bucket

    def _log_bucket(self, name: str, args: StorageArgs, account: pulumi.Input[str]
                    ) -> tuple[aws.s3.Bucket, aws.s3.BucketPolicy]:
        """The access-log bucket, hardened like the data bucket (rule 27); returns it and its
        policy, which lets S3's logging service write the data bucket's logs."""
        # Rule 27 (S3.9): every request to the data bucket is logged (S3 server access logs)
        # into a bucket of its own, private and TLS-only like the data bucket. S3 delivers
        # access logs only to a bucket encrypted with S3-managed keys (SSE-KMS targets are
        # not supported: https://docs.aws.amazon.com/AmazonS3/latest/userguide/enable-server-access-logging.html),
        # and, ACLs being disabled, the logging service is granted by the bucket policy.
        log_bucket = aws.s3.Bucket(
            f"{name}-logs-bucket",
            bucket_prefix=args.bucket_prefix[:BUCKET_PREFIX_MAX - len(LOG_SUFFIX)] + LOG_SUFFIX,
            force_destroy=False,
            tags={"Name": f"{args.cluster_name}-access-logs"},
            opts=pulumi.ResourceOptions(parent=self),
        )
        log_policy = self._harden(
            f"{name}-logs", log_bucket, sse_default(sse_algorithm="AES256"),
            args.noncurrent_version_days, args.abort_multipart_days,
            expire_days=args.access_log_days,
            allow=[{
                "Sid": "S3ServerAccessLogsOfTheDataBucket",
                "Effect": "Allow",
                "Principal": {"Service": "logging.s3.amazonaws.com"},
                "Action": "s3:PutObject",
                "Resource": pulumi.Output.concat(log_bucket.arn, f"/{ACCESS_LOG_PREFIX}*"),
                "Condition": {
                    "ArnLike": {"aws:SourceArn": self.bucket.arn},
                    "StringEquals": {"aws:SourceAccount": account},
                },
            }])
        return log_bucket, log_policy

    def _harden(self, name: str, bucket: aws.s3.Bucket, default,
                noncurrent_days: int, abort_days: int, expire_days: int | None = None,
                allow: list[dict] | None = None) -> aws.s3.BucketPolicy:
        """Ownership enforced, public access blocked, versioned, encrypted, lifecycle rules,
        TLS-only policy (rules 11-15) for ``bucket``; children named ``{name}-<what>``."""
        ownership, public_block = self._private(name, bucket.id)
        versioning = self._versioning_and_encryption(name, bucket.id, default)
        aws.s3.BucketLifecycleConfiguration(
            f"{name}-lifecycle",
            bucket=bucket.id,
            rules=lifecycle_rules(noncurrent_days, abort_days, expire_days),
            # AWS: lifecycle rules on noncurrent versions need versioning to exist first.
            opts=pulumi.ResourceOptions(parent=self, depends_on=[versioning]),
        )
        return aws.s3.BucketPolicy(
            f"{name}-policy",
            bucket=bucket.id,
            policy=tls_only_policy(bucket, allow),
            # S3 rejects a bucket policy while ownership/public-access settings are in flux.
            opts=pulumi.ResourceOptions(parent=self, depends_on=[ownership, public_block]),
        )

    def _private(self, name: str, bucket_id: pulumi.Output[str]) -> tuple[
            aws.s3.BucketOwnershipControls, aws.s3.BucketPublicAccessBlock]:
        """ACLs disabled and public access blocked (rules 11, 15)."""
        child = pulumi.ResourceOptions(parent=self)
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
        return ownership, public_block

    def _versioning_and_encryption(self, name: str, bucket_id: pulumi.Output[str],
                                   default) -> aws.s3.BucketVersioning:
        """Versioning on, and default encryption as ``default`` says; returns the
        versioning."""
        child = pulumi.ResourceOptions(parent=self)
        versioning = aws.s3.BucketVersioning(
            f"{name}-versioning",
            bucket=bucket_id,
            versioning_configuration=aws.s3.BucketVersioningVersioningConfigurationArgs(
                status="Enabled"),
            opts=child,
        )
        aws.s3.BucketServerSideEncryptionConfiguration(
            f"{name}-encryption",
            bucket=bucket_id,
            rules=[aws.s3.BucketServerSideEncryptionConfigurationRuleArgs(
                apply_server_side_encryption_by_default=default,
                # One data key per bucket instead of one KMS call per object: checkpoints are
                # many objects, and KMS requests are billed and rate limited.
                bucket_key_enabled=default.sse_algorithm == "aws:kms",
            )],
            opts=child,
        )
        return versioning
