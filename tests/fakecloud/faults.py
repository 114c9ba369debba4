"""EC2 capacity faults for the fake cloud: a small HTTP proxy in front of moto that answers
`RunInstances` for chosen (instance type, AZ) pairs with EC2's real capacity error, and passes
every other request to moto unchanged.

The nodes' EC2 endpoint (``AWS_ENDPOINT_URL_EC2`` in each node's SSH environment, which the
head's `ray start`, and so its autoscaler, inherit) is this proxy; S3 and everything else still
go to moto directly. It listens on the fake VPC's gateway only, as moto does. Ray's AWS node
provider gets the error as EC2 sends it (HTTP 500 with EC2's XML error document), botocore
parses it into a ``ClientError`` with code ``InsufficientInstanceCapacity``, and Ray handles it
as it would a real one: it retries the launch, then reports the node type unavailable to its
autoscaler with EC2's code and message.

A request's AZ is its subnet's (``SubnetId`` or the first network interface's, as Ray sends
the launch template's EFA interfaces), looked up in moto; ``Placement.AvailabilityZone`` when
given. Every RunInstances is recorded as (instance type, AZ, "refused" | "passed").
"""

from __future__ import annotations

import http.server
import threading
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable

# EC2's error document for a capacity shortfall, as the Query API returns it (HTTP 500).
CAPACITY_ERROR = (
    '<?xml version="1.0" encoding="UTF-8"?>\n<Response><Errors><Error>'
    "<Code>InsufficientInstanceCapacity</Code><Message>We currently do not have sufficient "
    "{itype} capacity in the Availability Zone you requested ({az}). Our system will be working "
    "on provisioning additional capacity. You can currently get {itype} capacity by not "
    "specifying an Availability Zone in your request or choosing a different Availability "
    "Zone.</Message></Error></Errors>"
    "<RequestID>4b5c2c70-0000-4000-8000-00000000000{n}</RequestID></Response>")

_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))   # never a proxy
_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "host"}


class CapacityFaults:
    """``refuse(type, az="*")`` makes EC2 have no capacity for that pair; ``allow_all()``
    lifts every refusal. ``launches`` lists what RunInstances asked for, in order."""

    def __init__(self, host: str, moto: str, subnet_az: Callable[[str], str]):
        self.moto, self.subnet_az = moto.rstrip("/"), subnet_az
        self.refused: set[tuple[str, str]] = set()
        self.launches: list[tuple[str, str, str]] = []
        self._lock = threading.Lock()
        faults = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self):   # noqa: N802  (boto3's EC2 Query API is POST)
                self._relay(self.rfile.read(int(self.headers.get("Content-Length") or 0)))

            def do_GET(self):   # noqa: N802
                self._relay(None)

            def _relay(self, body: bytes | None) -> None:
                refusal = faults._verdict(body)
                if refusal is not None:
                    return self._send(500, {"Content-Type": "text/xml"}, refusal)
                req = urllib.request.Request(
                    faults.moto + self.path, data=body, method=self.command,
                    headers={k: v for k, v in self.headers.items() if k.lower() not in _HOP})
                try:
                    with _DIRECT.open(req, timeout=60) as r:
                        self._send(r.status, dict(r.headers.items()), r.read())
                except urllib.error.HTTPError as e:
                    self._send(e.code, dict(e.headers.items()), e.read())

            def _send(self, status: int, headers: dict, data: bytes) -> None:
                self.send_response(status)
                for k, v in headers.items():
                    if k.lower() not in _HOP:
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *_):
                pass

        self.server = http.server.ThreadingHTTPServer((host, 0), Handler)
        self.server.daemon_threads = True
        self.endpoint = f"http://{host}:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever,
                                        name="capacity-faults", daemon=True)
        self._thread.start()

    def refuse(self, instance_type: str, az: str = "*") -> None:
        with self._lock:
            self.refused.add((instance_type, az))

    def allow_all(self) -> None:
        with self._lock:
            self.refused.clear()

    def _verdict(self, body: bytes | None) -> bytes | None:
        form = urllib.parse.parse_qs((body or b"").decode(errors="replace"))
        if form.get("Action") != ["RunInstances"]:
            return None
        itype = (form.get("InstanceType") or ["?"])[0]
        subnet = (form.get("SubnetId") or form.get("NetworkInterface.1.SubnetId") or [""])[0]
        az = (form.get("Placement.AvailabilityZone") or [""])[0] or \
            (self.subnet_az(subnet) if subnet else "?")
        with self._lock:
            refused = (itype, az) in self.refused or (itype, "*") in self.refused
            self.launches.append((itype, az, "refused" if refused else "passed"))
            n = len(self.launches) % 10
        return CAPACITY_ERROR.format(itype=itype, az=az, n=n).encode() if refused else None

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
