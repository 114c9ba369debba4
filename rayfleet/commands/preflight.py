"""`rayfleet preflight CONFIG`: before any money is spent, check that the AWS account can
launch the cluster YAML, and that a job's scaling request fits some node type.

Offline checks first (token file, GPUs asked for vs node types), then read-only AWS calls plus
one test object in the bucket: subnets and their AZs offer each instance type
(describe_instance_type_offerings), security groups, launch templates (and, for templates that
are the network source, their interfaces carry subnet and groups), AMIs, instance profiles and
key pairs exist, EC2 service quotas for P instances (on-demand and spot; every GPU worker type
of the catalog is a P type) cover the most vCPUs the worker types can run together (each up to
its max_workers, all within the cluster's max_workers, largest first), and the bucket is
reachable and writable. Each worker type is checked on its own: offered in every AZ it may
launch in (its launch templates' subnets: the workers' AZ and each of
rayfleet:workerFallbackAzs), its templates present; a fallback AZ's node types are more node
types under the same max_workers, so the quota need is unchanged. Prints a table of PASS /
FAIL / UNKNOWN with the fix; exits 1 if anything FAILs. UNKNOWN (e.g. a service the
credentials cannot query) is reported, never a crash.

Reserved capacity comes first: every node type that targets a capacity reservation (its node
config's or its launch template's CapacityReservationSpecification) gets one line per
reservation: id, state, instance type, AZ, available/total instances and, for a Capacity
Block, its start and end. A reservation a launch could not use is refused in one line before
anything else is checked (exit 2): not found, not active (a Capacity Block may also be
scheduled), of another instance type than the node type, in an AZ the stack has no private
subnet in (or not the AZ of the node type's subnet), or ending within ``--hours``. A resource
group's reservations are listed through Resource Groups (ListGroupResources); the group is
refused when none of them could take the node type's workers.
"""

from __future__ import annotations

import re
import stat
import sys
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path

from rayfleet import catalog
from rayfleet.clusteryaml import ClusterYaml, at_once, bucket_from_header, load, render_facts
from rayfleet.configkeys import AWS_REGIONS
from rayfleet.entrypoint import bounded
from rayfleet.errors import ClusterError, ConfigError, RayfleetError, did_you_mean
from rayfleet.facts import CAPACITY_BLOCK_MARKET_TYPE, S3_BUCKET_NAME
from rayfleet.commands.preflight_reservations import describe_reservation, reservation_problem

PASS, FAIL, UNKNOWN = "PASS", "FAIL", "UNKNOWN"

# EC2 service quotas, in vCPUs (https://docs.aws.amazon.com/ec2/latest/instancetypes/ec2-instance-quotas.html).
P_QUOTAS = {"on-demand": ("L-417A185B", "Running On-Demand P instances"),
            "spot": ("L-7212CCBC", "All P Spot Instance Requests")}

# `rayfleet preflight --hours`: how long the cluster must be able to run; a reservation that
# ends sooner (a Capacity Block's fixed end, or an ODCR's end date) is refused.
DEFAULT_HOURS = 1.0
RESOURCE_TYPE = "AWS::EC2::CapacityReservation"
# --hours' bound: half a year, past any Capacity Block (AWS sells them by the day and week).
MAX_HOURS = 182 * 24


def add_arguments(p) -> None:
    """preflight's flags beyond the YAML, GPUs and bucket (the CLI adds them here)."""
    p.add_argument("--hours", type=bounded(float, lambda h: 0 < h <= MAX_HOURS,
                                           f"more than 0 and at most {MAX_HOURS}"),
                   default=DEFAULT_HOURS,
                   help="hours the cluster must be able to run from now: a Capacity Block or "
                        f"reservation ending sooner is refused (default {DEFAULT_HOURS:g})")


@dataclass
class Check:
    status: str
    name: str
    detail: str
    fix: str = ""


def _client_error():
    from botocore.exceptions import BotoCoreError, ClientError

    return (BotoCoreError, ClientError)


def _code(e: Exception) -> str:
    return getattr(e, "response", {}).get("Error", {}).get("Code", type(e).__name__)


def gpus_fit(cfg: dict, num_gpus: int) -> str:
    """The node type that offers ``num_gpus``; raises ClusterError (one line) if none does."""
    best = 0
    for t in ClusterYaml(cfg).node_types():
        gpus = int(t.resources.get("GPU", 0) or 0)
        if gpus >= num_gpus and (t.spec.get("max_workers", 1) or t.head):
            return t.name
        best = max(best, gpus)
    raise ClusterError(f"no node type offers {num_gpus} GPUs (the most is {best}); the job "
                       "would wait forever: ask for at most that many per worker, or spread "
                       "the job over more workers")


def quota_need(types: list[tuple[int, int]], cap: int | None) -> int:
    """The most vCPUs a market's P node types can run at once: each type up to its
    max_workers, all of them together up to the cluster's max_workers (several worker types
    share it), the largest types first."""
    return sum(cpus * n for cpus, n in at_once(sorted(types, reverse=True), cap))


def token_check(cfg: dict) -> Check:
    mounts = cfg.get("file_mounts") or {}
    local = next((v for k, v in mounts.items() if "token" in str(k)), None)
    if local is None:
        return Check(FAIL, "token", "no token file in file_mounts",
                     "render the YAML with `rayfleet render` (it ships the token)")
    p = Path(str(local)).expanduser()
    if not p.is_file() or not p.read_text().strip():
        return Check(FAIL, "token", f"{local} is missing or empty",
                     "re-run `rayfleet render` (it creates the token, mode 0600)")
    mode = stat.S_IMODE(p.stat().st_mode)
    if mode & 0o077:
        return Check(FAIL, "token", f"{local} has mode {mode:o}", f"chmod 600 {local}")
    return Check(PASS, "token", f"{local} present, mode 600")


class Preflight:
    def __init__(self, cfg: dict, session=None):
        import boto3

        self.cfg = cfg
        self.region = (cfg.get("provider") or {}).get("region")
        self.session = session or boto3.session.Session(region_name=self.region)
        if self.session.get_credentials() is None:
            # Every check below would FAIL for this one reason, each with a misleading fix.
            raise RayfleetError("no AWS credentials found (environment, AWS_PROFILE, ~/.aws, "
                                "SSO or an instance role): set them (e.g. `export "
                                "AWS_PROFILE=...`), then run preflight again")
        self.ec2 = self.session.client("ec2", region_name=self.region)
        self.checks: list[Check] = []
        self._templates: dict[str, dict] = {}

    def add(self, *a, **kw) -> None:
        self.checks.append(Check(*a, **kw))

    def template(self, nc: dict) -> dict | None:
        lt = nc.get("LaunchTemplate")
        if not lt:
            return None
        key = lt.get("LaunchTemplateId") or lt.get("LaunchTemplateName")
        if key not in self._templates:
            kw = {"LaunchTemplateId": lt["LaunchTemplateId"]} if "LaunchTemplateId" in lt \
                else {"LaunchTemplateName": lt["LaunchTemplateName"]}
            try:
                v = self.ec2.describe_launch_template_versions(
                    Versions=[str(lt.get("Version", "$Default"))], **kw)["LaunchTemplateVersions"]
                data = v[0]["LaunchTemplateData"] if v else None
                self.add(PASS if data else FAIL, f"launch template {key}",
                         "exists" if data else "version not found",
                         "" if data else "re-run `pulumi up`, then `rayfleet render`")
            except _client_error() as e:
                data = None
                self.add(FAIL, f"launch template {key}", _code(e),
                         "re-run `pulumi up`, then `rayfleet render`")
            self._templates[key] = data
        return self._templates[key]

    def run(self, bucket: str | None, hours: float = DEFAULT_HOURS) -> list[Check]:
        self.check_reservations(hours)  # raises, before anything else, on one it cannot use
        subnets: dict[str, set[str]] = {}  # instance type -> subnets
        sgs: set[str] = set()
        amis: set[str] = set()
        profiles: set[str] = set()
        keys: set[str] = set()
        # Per market, (vCPUs, max workers) of each P worker node type.
        p_types: dict[str, list[tuple[int, int]]] = {"on-demand": [], "spot": []}
        for t in ClusterYaml(self.cfg).node_types():
            name, nc = t.name, t.node_config
            lt = self.template(nc) or {}
            itype = nc.get("InstanceType") or lt.get("InstanceType")
            nets = lt.get("NetworkInterfaces") or []
            sn = list(nc.get("SubnetIds") or [])
            if not sn:
                sn = [n["SubnetId"] for n in nets if n.get("SubnetId")]
            node_sgs = list(nc.get("SecurityGroupIds") or lt.get("SecurityGroupIds") or [])
            for n in nets:
                node_sgs += n.get("Groups") or []
            if not sn or not node_sgs:
                self.add(FAIL, f"{name} network", "neither the node config nor its launch "
                         "template names subnets and security groups; Ray would create "
                         "permissive defaults", "render the YAML from the stack outputs")
            subnets.setdefault(itype, set()).update(sn)
            sgs.update(node_sgs)
            ami = nc.get("ImageId") or lt.get("ImageId")
            if ami:
                amis.add(ami)
            else:
                self.add(FAIL, f"{name} AMI", "no ImageId in node config or launch template",
                         "set amiId or let the stack pick the Deep Learning AMI")
            prof = (nc.get("IamInstanceProfile") or lt.get("IamInstanceProfile") or {})
            if prof.get("Arn") or prof.get("Name"):
                profiles.add(prof.get("Arn") or prof.get("Name"))
            else:
                self.add(FAIL, f"{name} profile", "no IamInstanceProfile",
                         "set it: Ray would attach ray-autoscaler-v1 (full access)")
            if nc.get("KeyName") or lt.get("KeyName"):
                keys.add(nc.get("KeyName") or lt.get("KeyName"))
            # A reservation's workers run in capacity the account already holds: an ODCR counts
            # against the On-Demand quota from its creation, used or not, and Capacity Blocks
            # have limits of their own (at most 256 instances across blocks), so they add
            # nothing to the quotas below.
            reserved = (nc.get("CapacityReservationSpecification")
                        or lt.get("CapacityReservationSpecification") or {}).get(
                "CapacityReservationTarget")
            if itype and catalog.quota_group(itype) == "P" and not reserved and not t.head:
                market = (nc.get("InstanceMarketOptions") or lt.get("InstanceMarketOptions")
                          or {}).get("MarketType", "on-demand")
                cpus = int(t.resources.get("CPU", 0) or 0)
                p_types["spot" if market == "spot" else "on-demand"].append(
                    (cpus, t.max_workers or 0))
        self.check_subnets_and_offerings(subnets)
        self.check_ids("security groups", sgs, lambda ids: self.ec2.describe_security_groups(
            GroupIds=ids)["SecurityGroups"], "re-run `pulumi up`, then `rayfleet render`")
        self.check_ids("AMIs", amis, lambda ids: self.ec2.describe_images(ImageIds=ids)[
            "Images"], "pin an AMI that exists in this region (rayfleet:amiId)")
        self.check_ids("key pairs", keys, lambda ids: self.ec2.describe_key_pairs(
            KeyNames=ids)["KeyPairs"],
            "rayfleet keypair CLUSTER_YAML (creates it and its 0600 private key file)")
        self.check_profiles(profiles)
        cap = self.cfg.get("max_workers")
        self.check_quotas({m: quota_need(t, cap) for m, t in p_types.items()})
        if bucket:
            self.check_bucket(bucket)
        else:
            self.add(UNKNOWN, "bucket", "no storage in render's facts beside the YAML, nor "
                                        "--bucket",
                     "pass --bucket s3://<bucket>/<prefix>")
        return self.checks

    def _reserved_node_types(self) -> list[tuple[str, str, bool, dict, list[str]]]:
        """(node type, instance type, is a Capacity Block, CapacityReservationTarget, subnet
        ids) of every worker node type that targets reserved capacity."""
        out = []
        for t in ClusterYaml(self.cfg).workers():
            nc = t.node_config
            lt = self.template(nc) or {}
            spec = (nc.get("CapacityReservationSpecification")
                    or lt.get("CapacityReservationSpecification") or {})
            target = spec.get("CapacityReservationTarget") or {}
            if not target:
                continue
            market = (nc.get("InstanceMarketOptions") or lt.get("InstanceMarketOptions")
                      or {}).get("MarketType")
            subnets = list(nc.get("SubnetIds") or []) or [
                n["SubnetId"] for n in lt.get("NetworkInterfaces") or [] if n.get("SubnetId")]
            out.append((t.name, nc.get("InstanceType") or lt.get("InstanceType"),
                        market == CAPACITY_BLOCK_MARKET_TYPE, target, subnets))
        return out

    def _group_reservations(self, name: str, arn: str) -> list[str]:
        """The capacity reservation ids in resource group ``arn``."""
        rg = self.session.client("resource-groups", region_name=self.region)
        ids, token = [], None
        try:
            while True:
                page = rg.list_group_resources(Group=arn, **({"NextToken": token} if token
                                                             else {}))
                for r in page.get("Resources") or []:
                    ident = r.get("Identifier") or {}
                    if ident.get("ResourceType") == RESOURCE_TYPE:
                        ids.append(ident["ResourceArn"].rsplit("/", 1)[-1])
                token = page.get("NextToken")
                if not token:
                    break
        except _client_error() as e:
            raise ClusterError(f"{name}: resource group {arn} cannot be read ({_code(e)}); "
                               "check the ARN (rayfleet:capacityReservations) and that your "
                               "credentials may call resource-groups:ListGroupResources") \
                from None
        if not ids:
            raise ClusterError(f"{name}: resource group {arn} holds no capacity reservation; "
                               "add the reservations to it, or target one by id")
        return ids

    def check_reservations(self, hours: float = DEFAULT_HOURS) -> None:
        """One PASS line per reservation a node type targets; a ClusterError (one line) for
        the first one a launch could not use."""
        wanted = self._reserved_node_types()
        if not wanted:
            return
        head = ClusterYaml(self.cfg).head()
        # The head's subnets are the stack's private subnets, one per AZ (`rayfleet render`).
        stack_subnets = list((head.node_config if head else {}).get("SubnetIds") or []) or \
            sorted({s for w in wanted for s in w[4]})
        subnet_ids = sorted(set(stack_subnets).union(*(set(w[4]) for w in wanted)))
        try:
            subnet_az = {s["SubnetId"]: s["AvailabilityZone"] for s in
                         self.ec2.describe_subnets(SubnetIds=subnet_ids)["Subnets"]}
        except _client_error() as e:
            raise ClusterError(f"subnets {', '.join(subnet_ids)}: {_code(e)}; re-run `pulumi "
                               "up`, then `rayfleet render`") from None
        stack_azs = sorted({subnet_az[s] for s in stack_subnets if s in subnet_az})
        until = datetime.now(timezone.utc) + timedelta(hours=hours)
        for name, itype, block, target, subnets in wanted:
            node_azs = sorted({subnet_az[s] for s in subnets if s in subnet_az})
            group = target.get("CapacityReservationResourceGroupArn")
            ids = ([target["CapacityReservationId"]] if target.get("CapacityReservationId")
                   else self._group_reservations(name, group))
            try:
                found = self.ec2.describe_capacity_reservations(
                    CapacityReservationIds=ids)["CapacityReservations"]
            except _client_error() as e:
                raise ClusterError(f"{name}: capacity reservation {', '.join(ids)} not found "
                                   f"({_code(e)}) in {self.region}; check its id in "
                                   "rayfleet:capacityReservations") from None
            missing = sorted(set(ids) - {r["CapacityReservationId"] for r in found})
            if missing:
                raise ClusterError(f"{name}: capacity reservation {', '.join(missing)} not found "
                                   f"in {self.region}; check its id in "
                                   "rayfleet:capacityReservations")
            problems = []
            for r in found:
                problem = reservation_problem(r, itype, block, stack_azs, node_azs, until,
                                              hours)
                self.add(PASS, f"reservation {r['CapacityReservationId']}",
                         f"{name}: {describe_reservation(r)}"
                         + (f"; not usable by it: {problem}" if problem else ""))
                if problem:
                    problems.append(f"{name}: {r['CapacityReservationId']} {problem}")
            # By id, the one reservation must do; through a group, one usable member is enough.
            if problems and (not group or len(problems) == len(found)):
                raise ClusterError(problems[0])

    def check_ids(self, what: str, ids: set[str], describe, fix: str) -> None:
        if not ids:
            return
        try:
            found = describe(sorted(ids))
            self.add(PASS if len(found) >= len(ids) else FAIL, what,
                     ", ".join(sorted(ids)), "" if len(found) >= len(ids) else fix)
        except _client_error() as e:
            self.add(FAIL, what, f"{', '.join(sorted(ids))}: {_code(e)}", fix)

    def check_subnets_and_offerings(self, subnets: dict[str, set[str]]) -> None:
        all_ids = sorted(set().union(*subnets.values())) if subnets else []
        if not all_ids:
            return
        try:
            found = self.ec2.describe_subnets(SubnetIds=all_ids)["Subnets"]
        except _client_error() as e:
            self.add(FAIL, "subnets", f"{', '.join(all_ids)}: {_code(e)}",
                     "re-run `pulumi up`, then `rayfleet render`")
            return
        az = {s["SubnetId"]: s["AvailabilityZone"] for s in found}
        public = [s["SubnetId"] for s in found if s.get("MapPublicIpOnLaunch")]
        self.add(FAIL if public else PASS, "subnets",
                 f"{len(found)} found" + (f"; public IPs on launch in {public}" if public else ""),
                 "use the stack's private subnets" if public else "")
        for itype, ids in subnets.items():
            zones = sorted({az[i] for i in ids if i in az})
            if not itype or not zones:
                continue
            try:
                offered = {o["Location"] for o in self.ec2.describe_instance_type_offerings(
                    LocationType="availability-zone",
                    Filters=[{"Name": "instance-type", "Values": [itype]},
                             {"Name": "location", "Values": zones}])["InstanceTypeOfferings"]}
            except _client_error() as e:
                self.add(UNKNOWN, f"{itype} offered", _code(e))
                continue
            missing = [z for z in zones if z not in offered]
            self.add(FAIL if missing else PASS, f"{itype} offered",
                     f"in {', '.join(zones)}" + (f"; not in {', '.join(missing)}"
                                                 if missing else ""),
                     f"name AZs that offer {itype} in rayfleet:workerAz and "
                     f"rayfleet:workerFallbackAzs, or drop it from rayfleet:workerInstanceTypes"
                     if missing else "")

    def check_profiles(self, profiles: set[str]) -> None:
        if not profiles:
            return
        iam = self.session.client("iam")
        for p in sorted(profiles):
            name = p.rsplit("/", 1)[-1]
            try:
                iam.get_instance_profile(InstanceProfileName=name)
                self.add(PASS, "instance profile", name)
            except _client_error() as e:
                self.add(FAIL, "instance profile", f"{name}: {_code(e)}",
                         "re-run `pulumi up`, then `rayfleet render`")

    def check_quotas(self, vcpus: dict[str, int]) -> None:
        sq = self.session.client("service-quotas", region_name=self.region)
        for market, need in vcpus.items():
            if not need:
                continue
            code, label = P_QUOTAS[market]
            try:
                value = sq.get_service_quota(ServiceCode="ec2", QuotaCode=code)["Quota"]["Value"]
            except Exception as e:  # moto, or credentials without servicequotas:Get*
                self.add(UNKNOWN, f"quota {label}", f"cannot read ({_code(e)}); need {need} "
                         "vCPUs", "check Service Quotas in the console")
                continue
            ok = value >= need
            self.add(PASS if ok else FAIL, f"quota {label}",
                     f"{value:g} vCPUs, max workers need {need}",
                     "" if ok else f"request {code} >= {need} in Service Quotas (takes days)")

    def check_bucket(self, uri: str) -> None:
        m = re.fullmatch(rf"s3://({S3_BUCKET_NAME.pattern})/?(.*)", uri)
        if not m:
            self.add(FAIL, "bucket", f"{uri!r} is not s3://bucket/prefix")
            return
        bucket, prefix = m.group(1), m.group(2)
        s3 = self.session.client("s3", region_name=self.region)
        key = f"{prefix.rstrip('/') + '/' if prefix else ''}.rayfleet-preflight"
        try:
            s3.head_bucket(Bucket=bucket)
            s3.put_object(Bucket=bucket, Key=key, Body=b"ok")
            s3.delete_object(Bucket=bucket, Key=key)
            self.add(PASS, "bucket", f"s3://{bucket}/{key} written and deleted")
        except _client_error() as e:
            self.add(FAIL, "bucket", f"s3://{bucket}: {_code(e)}",
                     "check the stack's bucket and your credentials' access to its prefix")


def main(path: str, num_gpus: int | None = None, bucket: str | None = None, out=None,
         session=None, hours: float = DEFAULT_HOURS) -> int:
    out = out or sys.stdout
    cfg, _ = load(path)
    if (cfg.get("provider") or {}).get("type") != "aws":
        raise RayfleetError(f"{path}: preflight checks AWS clusters (provider.type: aws)")
    region = cfg["provider"].get("region")
    if region not in AWS_REGIONS:
        raise ConfigError("provider.region", f"{region!r} is not an AWS region"
                                             f"{did_you_mean(region, AWS_REGIONS)}")
    offline = [token_check(cfg)]
    if num_gpus is not None:
        fit = gpus_fit(cfg, num_gpus)  # raises before any AWS call
        offline.append(Check(PASS, f"{num_gpus} GPUs", f"node type {fit} offers them"))
    if bucket is None:   # render's, beside the YAML (an older YAML: its header comment)
        facts = render_facts(path)
        bucket = facts.storage_uri if facts else None
    checks = offline + Preflight(cfg, session).run(bucket, hours=hours)
    width = max(len(c.name) for c in checks)
    for c in checks:
        line = f"{c.status:8} {c.name:{width}}  {c.detail}"
        if c.fix and c.status != PASS:
            line += f"  -> {c.fix}"
        print(line, file=out)
    failed = sum(c.status == FAIL for c in checks)
    unknown = sum(c.status == UNKNOWN for c in checks)
    print(f"{len(checks)} checks: {failed} failed, {unknown} unknown", file=out)
    return 1 if failed else 0


__all__ = ["Check", "Preflight", "bucket_from_header", "describe_reservation", "gpus_fit", "main",
           "quota_need", "reservation_problem", "token_check"]
