"""The sections of a multi-node (DiLoCo) run: `[launch]` (nodes simulated on this machine),
`[mesh]` (joining the run's coordinator) and `[diloco]` (the outer step). Part of the run's
configuration, `prime_train.config`, which imports them; a single node without
`mesh.coordinator` ignores them.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, SecretStr, field_validator, model_validator

from prime_train.config_section import Section, check_folder_name


class LaunchConfig(Section):
    local_nodes: int = Field(
        1, ge=1, le=64, description="nodes simulated as local processes on this machine"
    )
    ranks_per_node: int = Field(
        1, ge=1, le=64, description="ranks (processes, FSDP2 shards) of each simulated node"
    )
    status_port: int | None = Field(
        None,
        ge=0,
        lt=65536,
        description="local launcher: serve the mesh status page on 127.0.0.1:PORT (0: a free one)",
    )


class MeshConfig(Section):
    coordinator: str | None = Field(None, description="HOST:PORT of the mesh coordinator")
    host: str | None = Field(
        None,
        description="address peers use to reach this node (default: the address of the "
        "interface that reaches the coordinator)",
    )
    serve_port: int = Field(
        0,
        ge=0,
        lt=65536,
        description="TCP port of the server sharing this node's checkpoints with joining "
        "peers (0: a free one; the local launcher's node K uses serve_port + K)",
    )
    serve_mbit: float = Field(
        500.0,
        ge=0.0,
        description="cap on the rate this node serves its checkpoints and update log to "
        "joiners, Mbit/s, all joiners together (0: no cap); default: half a 1 Gbit/s uplink, "
        "so a transfer never starves the members' all-reduce. Set it to about half your link",
    )
    fetch_mbit: float | None = Field(
        None,
        ge=0.0,
        description="cap on the rate a joiner fetches its snapshot while it listens, Mbit/s, "
        "from all donors together (0: no cap); default: 2 x serve_mbit, the whole link when "
        "serve_mbit is half of it. The fetch holds anyway while each round's all-reduce "
        "runs; set it lower to leave room for other traffic on the joiner's link",
    )
    node_name: str | None = Field(
        None,
        description="this node's name in the run, unique, the same across restarts (default: "
        "the host name plus '-K' for the local launcher's node K, else plus a short hash of "
        "the checkpoint folder); names its remote checkpoint prefix",
    )
    heartbeat_interval_s: float = Field(1.0, gt=0.0, description="seconds between heartbeats")
    heartbeat_timeout_s: float = Field(10.0, gt=0.0, description="silence before eviction")
    coordinator_grace_s: float = Field(
        120.0,
        ge=0.0,
        description="coordinator lost: seconds to retry its address at the next outer step "
        "before checkpointing the last committed outer step and exiting; also how long a "
        "starting node waits for a coordinator that does not answer yet",
    )
    join_timeout_s: float = Field(
        1800.0,
        gt=0.0,
        description="the longest a joining node waits to be admitted, and then listens to the "
        "members' rounds without catching up (its snapshot and the rounds it missed did not "
        "come), before it gives up and exits 1",
    )
    token: SecretStr | None = Field(
        None, description="shared secret; only from PRIME_TOKEN, never on the command line"
    )

    @field_validator("node_name")
    @classmethod
    def _node_name(cls, v: str | None) -> str | None:
        return v if v is None else check_folder_name(v)

    @field_validator("coordinator")
    @classmethod
    def _hostport(cls, v: str | None) -> str | None:
        if v is None:
            return v
        host, sep, port = v.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError("write it as HOST:PORT, e.g. 10.0.0.1:29500")
        return v

    @model_validator(mode="after")
    def _timeouts(self) -> MeshConfig:
        if self.heartbeat_timeout_s <= self.heartbeat_interval_s:
            raise ValueError(
                "heartbeat_timeout_s must exceed heartbeat_interval_s "
                f"({self.heartbeat_timeout_s} <= {self.heartbeat_interval_s})"
            )
        return self


class DilocoConfig(Section):
    inner_steps: int = Field(50, ge=1, description="H: inner steps between outer steps")
    outer_lr: float = Field(0.7, gt=0.0, description="outer SGD learning rate")
    outer_momentum: float = Field(0.9, ge=0.0, lt=1.0, description="outer Nesterov momentum")
    compression: Literal["uint8", "uint4", "uint2", "none"] = Field(
        "uint8",
        description="pseudo-gradient all-reduce: 'uint8', 'uint4' or 'uint2' (8, 4 or 2 bits "
        "per element, blockwise codebooks) or 'none' (float32)",
    )
    error_feedback: bool = Field(
        False,
        description="carry what the compression took from this node's pseudo-gradient (its "
        "quantization residual) into the next round's; needs compression 'uint8', 'uint4' or "
        "'uint2'",
    )
    norm_bound: float = Field(
        10.0,
        ge=0.0,
        description="a node whose pseudo-gradient's L2 norm exceeds this many times the median "
        "of the other nodes' is left out of that round (0: never); a non-finite norm always is",
    )
    overlap: Literal["none", "delayed"] = Field(
        "none",
        description="'none': inner steps wait for each outer step; 'delayed': the all-reduce of "
        "round k runs in the background during round k+1 and its update is applied at the end "
        "of round k+1",
    )
    fragments: int = Field(
        1,
        ge=1,
        description="F: streaming outer steps. The layers are split into F strided fragments "
        "(layer i in fragment i % F) and one fragment syncs every inner_steps / F steps, each "
        "sync its own outer step; every parameter still syncs once every inner_steps. With "
        "overlap = 'delayed' each fragment's all-reduce runs behind the inner_steps / F steps "
        "to the next fragment's sync point, where it is applied. 1: the whole model at once",
    )
    sync_timeout_s: float = Field(
        0.0,
        ge=0.0,
        description="once the first node reaches a sync point, seconds the others have to "
        "follow before they are left out of the round (evicted; they rejoin by themselves). "
        "0: auto, 4x the largest arrival spread of the last 8 sync points, within [30, 600] s",
    )
    round_seconds: float = Field(
        0.0,
        ge=0.0,
        description="T: each node runs inner steps until its round has lasted T seconds (at "
        "least min_inner_steps, at most inner_steps), then syncs; the average weights each "
        "node by the tokens it trained that round. 0: every round is inner_steps steps",
    )
    min_inner_steps: int = Field(
        1, ge=1, description="with round_seconds > 0: inner steps a node runs in every round"
    )
    max_missed_rounds: int = Field(
        3,
        ge=1,
        description="a node left out of this many rounds in a row (late at the sync point) "
        "exits 1; a round it contributed to resets the count",
    )
    max_rejoins: int = Field(
        3,
        ge=0,
        description="times a node that lost its membership (evicted: a cut link, a stall past "
        "the heartbeat timeout) rejoins the running job by itself before it exits 1",
    )
    rejoin_wait_s: float = Field(
        300.0, gt=0.0, description="how long such a node waits for the coordinator and members"
    )
    replay_rounds: int = Field(
        8,
        ge=0,
        description="K: committed updates (averaged pseudo-gradients) each node keeps on disk "
        "and serves, so a joiner whose checkpoint took up to K rounds to arrive replays them "
        "and enters (4 bytes per parameter each; 0: none, a late joiner takes a newer one)",
    )

    @model_validator(mode="after")
    def _feedback(self) -> DilocoConfig:
        if self.error_feedback and self.compression == "none":
            raise ValueError(
                "error_feedback = true needs a quantized compression ('uint8', 'uint4' or "
                "'uint2'): with 'none' nothing is lost to carry"
            )
        if self.fragments > 1 and self.inner_steps % self.fragments:
            raise ValueError(
                f"fragments = {self.fragments} must divide inner_steps = {self.inner_steps} "
                "(a fragment syncs every inner_steps / fragments inner steps)"
            )
        if self.fragments > 1 and self.round_seconds > 0:
            raise ValueError(
                f"fragments = {self.fragments} needs round_seconds = 0 (streaming fragments "
                "sync at fixed inner steps for now)"
            )
        if self.round_seconds > 0 and self.min_inner_steps > self.inner_steps:
            raise ValueError(
                f"min_inner_steps = {self.min_inner_steps} is more than inner_steps = "
                f"{self.inner_steps} (the most a round runs)"
            )
        return self
