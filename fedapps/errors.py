"""The errors a user can fix (bad data, model files, settings): each message names the fix, so the
ClientApp replies with it in one line (``fedapps.client_app.one_line_errors``) and the ServerApp logs it
in one line (``fedapps.server_app``), neither with a traceback. A bug's exception keeps its traceback."""

from __future__ import annotations

from clients.adapters import AdapterError
from clients.assets import AssetMissing, ConversionError
from clients.models.llm import ModelError
from clients.models.weights import CheckpointError
from clients.partition import PartitionError
from clients.pool import PoolError
from clients.tasks.base import TaskError
from fedapps.channel import ChannelError
from fedapps.method import ConfigError

# what a node can find wrong with its data, model files or settings
NODE_ERRORS = (TaskError, PartitionError, AssetMissing, ConversionError, ModelError, CheckpointError, AdapterError,
               PoolError, ConfigError, ChannelError)
