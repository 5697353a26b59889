# expect: ok
# stdout: got 10
import asyncio


async def compute():
    await asyncio.sleep(0)
    return 10

value = await compute()
print("got", value)
