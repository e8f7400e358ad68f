"""The ids that travel between services: typed so a block id is never passed as a request id."""

from typing import NewType

RequestId = NewType("RequestId", str)
BlockId = NewType("BlockId", int)
