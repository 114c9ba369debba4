"""moto_server, with EC2's address release: the fake cloud's moto (tests/fakecloud/cloud.py).

EC2 frees a terminated instance's private address (a new instance may take it, as a replaced
head of a rayfleet:headHa stack does, at its fixed address). moto 5.2 keeps it until the
Instance object is garbage-collected, which never happens while DescribeInstances lists the
terminated instance, so RunInstances with that PrivateIpAddress fails with "IP already in
use". Here TerminateInstances releases the addresses as EC2 does, but not into moto's pool of
addresses to hand out again first: moto gives the last one freed to the next instance launched
without an address (last in, first out). Once an instance launched in the seconds after the
head's termination (never set up: the dying head's autoscaler is the only launcher left) took
the head's fixed address that way, and the replaced head's `ray up` failed with "IP already in
use" (a 500). EC2 picks a free address of the subnet
instead, where a just-freed one is as unlikely as any other.

moto's backends are not thread-safe either (getmoto/moto#5881): one request is served at a
time (the server keeps its threads; the backends see one caller).

Run as moto_server is: ``python motoserver.py -H HOST -p PORT``."""

from __future__ import annotations

import sys
import threading

from moto.ec2.models.instances import Instance
from moto.moto_server.werkzeug_app import DomainDispatcherApplication
from moto.server import main

_terminate = Instance.terminate


def _terminate_and_release(self):
    state = _terminate(self)
    try:
        subnet = self.ec2_backend.get_subnet(self.subnet_id)
    except Exception:   # noqa: BLE001  (an instance outside any subnet holds none)
        subnet = None
    if subnet is not None:
        for ip in self._private_ips:
            subnet.del_subnet_ip(ip)
            subnet._unused_ips.discard(ip)   # free, but not first in line (above)
        self._private_ips.clear()
    return state


Instance.terminate = _terminate_and_release

_dispatch = DomainDispatcherApplication.__call__
_one_at_a_time = threading.Lock()


def _serialized(self, environ, start_response):
    with _one_at_a_time:
        return _dispatch(self, environ, start_response)


DomainDispatcherApplication.__call__ = _serialized

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
