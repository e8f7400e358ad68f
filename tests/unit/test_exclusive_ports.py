"""A second gRPC server on a taken port fails with 'address in use' instead of sharing it."""

from __future__ import annotations

import pytest

from pagoda.runtime.tls import AddressInUseError, add_port, new_server


async def test_a_second_server_on_the_same_port_is_refused():
    first = new_server()
    port = add_port(first, "127.0.0.1:0")
    await first.start()
    try:
        second = new_server()
        with pytest.raises(AddressInUseError, match=f"address in use: cannot listen on 127.0.0.1:{port}"):
            add_port(second, f"127.0.0.1:{port}")
    finally:
        await first.stop(0)
