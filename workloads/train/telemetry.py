"""The training loop's numbers as Ray metrics: Prometheus scrapes them from Ray's metrics
endpoints with everything else, and the kit's Grafana dashboard (rayfleet/dashboards) plots
them per run."""

from __future__ import annotations

# Loop metric -> (Ray metric name, description). Prometheus sees each with Ray's `ray_` prefix,
# e.g. ray_rayfleet_train_loss{run="..."}.
GAUGES = {
    "loss": ("rayfleet_train_loss", "Training loss, mean over the last log interval"),
    "tokens_per_s": ("rayfleet_train_tokens_per_s", "Training tokens per second, all workers"),
    "data_wait_frac": ("rayfleet_train_data_wait_frac",
                       "Fraction of step time spent waiting for the next batch"),
    "step": ("rayfleet_train_step", "Optimizer steps done"),
    "slowest_rank": ("rayfleet_train_slowest_rank",
                     "The rank with the longest forward pass in the last log interval"),
    "slowest_ratio": ("rayfleet_train_slowest_ratio",
                      "The slowest rank's forward time over the other ranks' median (a "
                      "straggler from 1.5)"),
}
TAG_KEYS = ("run",)


class Telemetry:
    """One run's gauges, set at each log point."""

    def __init__(self, run: str):
        from ray.util.metrics import Gauge

        self._tags = {"run": run}
        self._gauges = {key: Gauge(name, description, tag_keys=TAG_KEYS)
                        for key, (name, description) in GAUGES.items()}

    def export(self, metrics: dict) -> None:
        for key, gauge in self._gauges.items():
            value = metrics.get(key)
            if value is not None and value == value:   # NaN: unknown (one rank), not set
                gauge.set(float(value), tags=self._tags)
