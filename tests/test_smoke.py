from rackctl.client import Client
from tests.conftest import GiB, usage_is, wait_state


async def test_create_start_stop_delete(client: Client, project: tuple[str, str]) -> None:
    silo, proj = project
    v = await client.instance_create(silo, proj, "web", vcpus=2, ram_bytes=4 * GiB, disk_bytes=10 * GiB)
    assert v["state"] == "stopped"
    await client.instance("start", silo, proj, "web")
    await wait_state(client, silo, proj, "web", "running")
    await usage_is(client, {"vcpus": 2, "ram_bytes": 4 * GiB, "disk_bytes": 10 * GiB}, silo, proj)
