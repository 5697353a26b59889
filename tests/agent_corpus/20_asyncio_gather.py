# expect: ok
# stdout: ['task-0', 'task-1', 'task-2']
import asyncio


async def job(i):
    await asyncio.sleep(0.01 * (3 - i))
    return f"task-{i}"


async def main():
    results = await asyncio.gather(*(job(i) for i in range(3)))
    print(results)


asyncio.run(main())
