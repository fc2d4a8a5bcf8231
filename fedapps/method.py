"""What a method is to Postcard: one :class:`Method` record per algorithm.

A method gives the common ClientApp (``fedapps.client_app``) and the common server
(``fedapps.runner``) four functions; ``fedapps.registry`` registers every record in one
place (PEFT's ``register_peft_method`` is the model):

* ``prepare(cfg) -> (model, tokenizer, extra)`` builds what a client trains, once per
  process (``fedapps.session.session``);
* ``train(call) -> Update`` and ``evaluate(call) -> metrics`` answer one message: the
  ClientApp has already read the run's config, opened the node's session and will add
  ``partition-id`` to the metrics and build the reply;
* ``plan_server(cfg, *, on_round_end, config_yaml) -> ServerPlan`` builds the strategy and
  says how to save the final global state;
* ``restore(cfg, run_dir) -> (model, tokenizer)`` rebuilds the final global model from what
  ``save_final`` wrote (``fedapps.final.load_run``: inference, evaluation, export).

and, where it differs from the defaults, what the wiring needs to know about it (so nothing
outside its module names it): ``check`` (its settings, at compose time), ``errors`` (its
user-facing error types), ``export`` (how its final model becomes static weights, or why it
cannot), ``latent_downlink``, ``strategy``, ``own_format``; see :class:`Method`.

The model kinds a method runs on are declared in its ``conf/algorithm/<name>.yaml``
(``models:``) and checked when the config is composed, before any model is imported: a
method's module imports torch and its client code inside the functions that use them, so
``fedapps.registry`` and composing a config import no torch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict

from strategies.uplink import Wire


@dataclass(frozen=True)
class ServerPlan:
    """What a method gives the common runner: its strategy, and how to save the result."""

    strategy: object
    save_final: Callable  # (global_state: dict[str, np.ndarray], run_dir: Path) -> dict | None


@dataclass
class ClientCall:
    """One message to a client: the run's config, the node's session, the message itself."""

    msg: Message
    context: Context
    cfg: object  # the run's resolved config (as the server sent it)
    session: object  # fedapps.session.Session: this process's model and this node's task

    @property
    def config(self) -> ConfigRecord:
        """The server's per-message settings (``server-round``, strategy extras)."""
        return self.msg.content["config"]

    @property
    def arrays(self) -> ArrayRecord:
        """The downlink: the global state in the strategy's wire format."""
        return self.msg.content["arrays"]

    @property
    def server_round(self) -> int:
        return int(self.config.get("server-round", 0))

    @property
    def scores_local(self) -> bool:
        """``algorithm.eval_local``: score the freshly trained model before replying (the aggregation
        drop) in every round (true), in the run's last round only (last), or never (false)."""
        value = self.cfg.algorithm.get("eval_local", False)
        return self.server_round == int(self.cfg.rounds) if value == "last" else bool(value)

    @property
    def seed(self) -> int:
        """This node's seed for this round (batches, dropout, stochastic rounding)."""
        return round_seed(self.cfg, self.server_round, self.session.partition_id)


@dataclass
class Update:
    """A client's training reply: its metrics, its uplink and any records of the method's own."""

    metrics: dict
    arrays: ArrayRecord
    records: dict[str, ConfigRecord] = field(default_factory=dict)
    content: RecordDict | None = None  # a reply form of the method's own, sent as it is (FLITE's compact reply)


class ConfigError(ValueError):
    """A configuration that cannot be composed or does not fit; the message names the fix (or lists the
    valid choices). ``fedapps.config`` raises it, and so does a method's ``check``."""


@dataclass(frozen=True)
class Method:
    """One federated method as Postcard runs it (see the module docstring)."""

    name: str
    prepare: Callable[[object], tuple]
    train: Callable[[ClientCall], Update]
    evaluate: Callable[[ClientCall], dict]
    plan_server: Callable[..., ServerPlan]
    restore: Callable[[object, object], tuple]  # (cfg, run_dir) -> (model, tokenizer)
    # (cfg) -> None, when the config is composed (fedapps.checks.validate; cfg still writable): its own
    # settings, as its clients and server will build them; raises ConfigError. Imports no torch.
    check: Callable[[object], None] | None = None
    # (cfg) -> None, before a run is submitted (fedapps.config.finalize, as `postcard` and postcard.app_run call
    # it; not plain compose, which composes configs to look at them): what the run needs on this machine besides
    # its settings (SmartFed: its knowledge pool), after every settings check; raises ConfigError. Its server
    # checks the same again (its machine may be another). Imports no torch.
    ready: Callable[[object], None] | None = None
    # its exception types whose message names the fix: the ServerApp logs them in one line, no traceback
    errors: tuple[type[BaseException], ...] = ()
    # its final model as static weights (fedapps.final.FinalModel.export): None = the model as it is
    # (a PEFT model merges its adapters); a callable model -> merged model; a string: why it cannot be
    export: Callable[[object], object] | str | None = None
    latent_downlink: bool = False  # its clients replay a latent downlink (channel.downlink=latent)
    # the strategy class plan_server builds (a PayloadFedAvg): its ``linear`` flag says whether differential
    # privacy and secure aggregation, which release a mean of updates, can carry it (checked at compose time)
    strategy: type | None = None
    own_format: str | None = None  # a compressed update format that is its own wire format (topk-ef: topk)
    reference: bool = False  # the byte reference of `postcard compare` (uplink_vs_fedavg_lora): the plain LoRA baseline


class FinalStateError(RuntimeError):
    """A run folder's final state is missing or does not fit its configuration."""


def final_file(run_dir, name: str):
    """``run_dir/name``, or a clear error when the run did not write it."""
    from pathlib import Path

    path = Path(run_dir) / name
    if not path.exists():
        raise FinalStateError(f"{path} is missing: the run did not finish, or was written by another version")
    return path


def learning_rates(cfg, patterns: dict[str, str]) -> dict[str, float]:
    """A method's ``algorithm.lr`` (``{kind: lr or null}``; null = ``train.lr``) as
    :func:`clients.train.local_train`'s ``lr_by_name``, through ``patterns`` (kind -> a part of
    the parameters' names)."""
    rates = cfg.algorithm.get("lr") or {}
    return {patterns[k]: float(v) for k, v in rates.items() if v is not None}


def round_seed(cfg, server_round: int, partition_id: int) -> int:
    return int(cfg.seed) * 1_000_003 + server_round * 1_009 + partition_id


def strategy_settings(cfg, *, config_yaml: str, on_round_end) -> dict:
    """The keyword arguments every strategy takes from the run's configuration: the bounds on
    each client's influence (the ``robust`` group), the server optimiser
    (``strategy.server_optimizer``), the YAML sent to each client once, the
    client count and minimum, the sampled fractions, and the runner's round-end callback."""
    from omegaconf import OmegaConf

    from fedapps import privacy, secure
    from strategies.robust import Robustness
    from strategies.server_opt import ServerOptimizer

    return dict(
        robustness=Robustness.from_mapping(OmegaConf.to_container(cfg.robust, resolve=True)),
        server_optimizer=ServerOptimizer.from_mapping(
            OmegaConf.to_container(cfg.strategy.server_optimizer, resolve=True)
            if cfg.strategy.get("server_optimizer") is not None else None),
        secure=secure.settings_of(cfg),
        privacy=privacy.settings_of(cfg),
        config_yaml=config_yaml,
        num_clients=int(cfg.num_clients),
        min_clients=cfg.strategy.min_clients,
        fraction_train=float(cfg.strategy.fraction_train),
        fraction_evaluate=float(cfg.strategy.fraction_evaluate),
        on_round_end=on_round_end,
    )


def uplink_kwargs(algorithm) -> dict:
    """The strategy's wire settings from ``algorithm.payload/downlink/uplink/compression``
    (:class:`strategies.uplink.Wire`: one default per key, checked once)."""
    return Wire.of(algorithm).strategy_kwargs()
