"""moto_server, with EC2's address release: the fake cloud's moto (tests/fakecloud/cloud.py).

EC2 frees a terminated instance's private address (a new instance may take it, as a replaced
head of a rayfleet:headHa stack does, at its fixed address). moto 5.2 keeps it until the
Instance object is garbage-collected, which never happens while DescribeInstances lists the
terminated instance, so RunInstances with that PrivateIpAddress fails with "IP already in
use". Here TerminateInstances releases the addresses as EC2 does: not at once, but once the
instance has shut down (HOLD_S; EC2 holds them through `shutting-down`, tens of seconds), and
not into moto's pool of addresses to hand out again first: moto gives the last one freed to the
next instance launched without an address (last in, first out), where EC2 picks a free address
of the subnet, a just-freed one as unlikely as any other. Both once let an instance launched in
the seconds after the head's termination take the head's fixed address (the dying head's
autoscaler, the only launcher left, saw its own instance gone and launched again, the head's
launch template naming that address), so that the replaced head's `ray up` failed. A launch at
an address in use is EC2's error (InvalidIPAddress.InUse, a 400), not moto's 500.

moto's backends are not thread-safe either (getmoto/moto#5881): one request is served at a
time (the server keeps its threads; the backends see one caller).

IAM, where the fake cloud turns moto's access control on (FakeCloud.enforce_iam; nothing here
changes a run that does not): S3 requests are judged against the caller's policies, a node's
being its instance role's; every other service is not judged, as moto's evaluator cannot do it
right: it hands every EC2 action the resource "*", so a statement scoped to ARNs (the head's
RunInstances, TerminateInstances on its cluster's tags) matches nothing, and it has no value
for any condition key but sts:ExternalId. For S3, as AWS does and moto 5.2 does not:
- the one condition key the node roles use, `s3:prefix` (a ListObjects request's `prefix`,
  absent when it has none): StringLike matches `*` and `?`; a key the request lacks fails the
  condition unless the operator ends in IfExists; an operator this stand-in does not know fails
  it (a statement it cannot judge never allows); a statement whose condition fails does not
  apply (moto 5.2 turns such an Allow into a Deny);
- HeadBucket is s3:ListBucket with no prefix (moto 5.2 asks for an "s3:HeadBucket" that no
  policy names);
- DeleteObjects is judged key by key, s3:DeleteObject on each object's ARN (moto 5.2 judges it
  on the bucket's ARN, so a role scoped to a prefix could never batch-delete); a batch with any
  key refused is refused whole, stricter than AWS, which deletes the others;
- a GetObject or HeadObject of a key that does not exist is 404 only for a caller allowed
  s3:ListBucket on the bucket, judged with no `s3:prefix` (the request has none), and 403 for
  the others, as AWS documents (moto 5.2: 404 for anyone allowed the object). Whether AWS counts
  a ListBucket allowed only under a prefix there is not documented: this takes the stricter
  reading, and the node roles' policy passes either way.

Run as moto_server is: ``python motoserver.py -H HOST -p PORT``."""

from __future__ import annotations

import fnmatch
import os
import sys
import threading
import urllib.parse

import xmltodict

from moto.core.authorization import ActionAuthenticatorMixin
from moto.ec2.exceptions import EC2ClientError
from moto.ec2.models.instances import Instance
from moto.ec2.models.subnets import Subnet
from moto.iam.access_control import IAMPolicyStatement, IAMRequestBase, PermissionResult
from moto.moto_server.werkzeug_app import DomainDispatcherApplication
from moto.s3.responses import S3Response
from moto.server import main

# Seconds a terminated instance keeps its addresses (its shutdown): past the moment the fake
# cloud stops the node's processes, and well inside fault 10's outage before its `ray up`.
HOLD_S = float(os.environ.get("RAYFLEET_FAKECLOUD_ADDRESS_HOLD_S", "10"))
_terminate = Instance.terminate
_request_ip = Subnet.request_ip


def _terminate_and_release(self):
    state = _terminate(self)
    try:
        subnet = self.ec2_backend.get_subnet(self.subnet_id)
    except Exception:   # noqa: BLE001  (an instance outside any subnet holds none)
        subnet = None
    if subnet is not None:
        held = list(self._private_ips)
        self._private_ips.clear()

        def release():
            with _one_at_a_time:
                for ip in held:
                    subnet.del_subnet_ip(ip)
                    subnet._unused_ips.discard(ip)   # free, but not first in line (above)

        timer = threading.Timer(HOLD_S, release)
        timer.daemon = True
        timer.start()
    return state


def _request_ip_as_ec2(self, ip: str, instance) -> None:
    if ip in self._subnet_ips:
        raise EC2ClientError("InvalidIPAddress.InUse", f"Address {ip} is in use.")
    return _request_ip(self, ip, instance)


Instance.terminate = _terminate_and_release
Subnet.request_ip = _request_ip_as_ec2

_dispatch = DomainDispatcherApplication.__call__
_one_at_a_time = threading.Lock()


def _serialized(self, environ, start_response):
    with _one_at_a_time:
        return _dispatch(self, environ, start_response)


DomainDispatcherApplication.__call__ = _serialized


# ---------------------------------------------------------------------- IAM (see above)

def _not_judged(self, resource: str = "*") -> None:
    """Services but S3: not judged (moto's evaluator gives EC2 no resource ARN)."""


ActionAuthenticatorMixin._authenticate_and_authorize_normal_action = _not_judged

# The condition values of the request being judged (one request at a time: _serialized).
_REQUEST: dict[str, str] = {}
_permitted = IAMRequestBase.check_action_permitted


def _with_values(self, resource: str) -> None:
    query = urllib.parse.parse_qs(urllib.parse.urlsplit(self._path).query,
                                  keep_blank_values=True)
    _REQUEST.clear()
    if self._action == "s3:ListBucket" and "prefix" in query:
        _REQUEST["s3:prefix"] = query["prefix"][0]
    try:
        _permitted(self, resource)
    finally:
        _REQUEST.clear()


IAMRequestBase.check_action_permitted = _with_values

OPERATORS = {"StringEquals": lambda expected, actual: actual == expected,
             "StringLike": lambda expected, actual: fnmatch.fnmatchcase(actual, expected)}


def holds(condition: dict, values: dict[str, str]) -> bool:
    """Whether a statement's Condition block holds for the request's ``values``, as AWS judges
    it (the module docstring); every operator and every key must hold."""
    for operator, keys in condition.items():
        base = operator.removesuffix("IfExists")
        test = OPERATORS.get(base)
        if test is None:
            return False
        for key, expected in keys.items():
            if key not in values:
                if operator.endswith("IfExists"):
                    continue
                return False
            wanted = expected if isinstance(expected, list) else [expected]
            if not any(test(str(e), values[key]) for e in wanted):
                return False
    return True


_statement = IAMPolicyStatement.is_action_permitted


def _statement_verdict(self, action, resource="*", principal=None,
                       incoming_condition_values=None):
    condition = self._statement.get("Condition")
    if not condition or "Principal" in self._statement:   # trust policies: moto's own way
        return _statement(self, action, resource, principal, incoming_condition_values)
    if not holds(condition, {**_REQUEST, **(incoming_condition_values or {})}):
        return PermissionResult.NEUTRAL
    plain = IAMPolicyStatement({k: v for k, v in self._statement.items() if k != "Condition"})
    return _statement(plain, action, resource, principal, incoming_condition_values)


IAMPolicyStatement.is_action_permitted = _statement_verdict

_s3_action = S3Response._authenticate_and_authorize_s3_action


def _per_key(self, bucket_name: str | None = None, key_name: str | None = None) -> None:
    if self.data.get("Action") == "HeadBucket":   # moto's name; IAM's action is ListBucket
        self.data["Action"] = "ListBucket"
    if key_name is None and bucket_name and self.data.get("Action") == "DeleteObject" \
            and self.is_delete_keys():
        objects = xmltodict.parse(self.body)["Delete"].get("Object") or []
        for obj in objects if isinstance(objects, list) else [objects]:
            _s3_action(self, bucket_name=bucket_name, key_name=obj["Key"])
        return
    _s3_action(self, bucket_name=bucket_name, key_name=key_name)
    if key_name and bucket_name and self.data.get("Action") == "GetObject" \
            and self.backend.get_object(bucket_name, key_name) is None:
        # A key that is not there: 404 only to a caller who may list the bucket, judged with
        # no s3:prefix (the request has none); 403 to the others (the module's text).
        self.data["Action"] = "ListBucket"
        try:
            _s3_action(self, bucket_name=bucket_name)
        finally:
            self.data["Action"] = "GetObject"


S3Response._authenticate_and_authorize_s3_action = _per_key

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
