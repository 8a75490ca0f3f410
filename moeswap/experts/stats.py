"""What the expert store counts, per layer and in total."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields


@dataclass
class LayerStats:
    requests: int = 0  # experts asked for (after any threshold drop)
    device_hits: int = 0
    host_hits: int = 0
    disk_misses: int = 0  # read from the model file
    transfers: int = 0  # moved up into a device slot
    computed_in_place: int = 0  # computed from a host slot or a staging buffer
    disk_bytes: int = 0
    transfer_bytes: int = 0
    device_evictions: int = 0
    host_evictions: int = 0
    refetches: int = 0  # evicted between a step's two passes and fetched again
    stall_seconds: float = 0.0  # spent waiting on reads and copies
    threshold_drops: int = 0  # picks dropped by --expert-threshold (an approximation)
    threshold_saved_bytes: int = 0  # expert bytes not read because every pick of it was dropped

    def add(self, other: "LayerStats") -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    @property
    def hit_rate(self) -> float:
        return (self.device_hits + self.host_hits) / self.requests if self.requests else 0.0

    def as_dict(self) -> dict:
        return {**asdict(self), "hit_rate": self.hit_rate}


def total(layers: dict[int, LayerStats]) -> LayerStats:
    result = LayerStats()
    for stats in layers.values():
        result.add(stats)
    return result
