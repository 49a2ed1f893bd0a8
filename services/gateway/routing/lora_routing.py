"""Which scheduler replicas already run a LoRA adapter, so the router sends its requests there (the adapter is
loaded in that replica's worker, and its prefix cache holds the adapter's blocks). Learned from where this
gateway routed the adapter's requests; a replica much busier than the least loaded one is passed over (as
prefix affinity is, by the router's `imbalance`)."""

from __future__ import annotations

from collections.abc import Callable


class LoraHomes:
    def __init__(self) -> None:
        self.homes: dict[str, list[int]] = {}        # adapter -> replica indices that ran it, most recent last

    def record(self, lora_name: str, index: int) -> None:
        if not lora_name:
            return
        homes = self.homes.setdefault(lora_name, [])
        if index in homes:
            homes.remove(index)
        homes.append(index)

    def forget(self, lora_name: str) -> None:
        self.homes.pop(lora_name, None)

    def prefer(self, lora_name: str, choice: int, up: list[int], load: Callable[[int], int], imbalance: int) -> int:
        """The least loaded up replica that ran the adapter, unless it is `imbalance` requests busier than
        `choice`; else `choice`."""
        homes = [i for i in self.homes.get(lora_name, ()) if i in up] if lora_name else []
        if not homes or choice in homes:
            return choice
        home = min(homes, key=load)
        return home if load(home) - load(choice) <= imbalance else choice
