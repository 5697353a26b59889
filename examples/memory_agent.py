"""An agent's program that orchestrates an MCP server from inside the sandbox.

Run it with:  codecage run --mcp-config examples/mcp.json --file examples/memory_agent.py

Instead of calling the knowledge-graph tools one by one through its context window, the
agent writes this one program: it finds the tools it needs, stores what it learned about a
few projects, reads the whole graph back, filters it in code, keeps a report in the
workspace, and returns only the short answer. The sandbox has no network and never sees
how the memory server is reached: every call goes over codecage's private tool bridge.
"""

from servers.memory import create_entities, create_relations, read_graph

from codecage.runtime import search_tools, workspace

# 1. Which tools are there for this? (read from /servers without importing anything)
for ref in search_tools("create entities relations graph", detail="basic", limit=3):
    print(f"found {ref.module}: {ref.summary}")

# 2. Store what the agent learned, in two calls instead of a dozen tool round trips.
projects = {
    "codecage": ["sandbox", "python", "mcp"],
    "ledger": ["billing", "postgres"],
    "atlas": ["maps", "python"],
}
await create_entities.call(
    entities=[
        {"name": name, "entityType": "project", "observations": [f"uses {t}" for t in tags]}
        for name, tags in projects.items()
    ]
    + [{"name": "ana", "entityType": "person", "observations": ["maintainer"]}]
)
await create_relations.call(
    relations=[
        {"from": "ana", "to": name, "relationType": "maintains"} for name in ("codecage", "atlas")
    ]
)

# 3. Read the graph back and keep only what matters, here, not in the model's context.
graph = await read_graph.call()
python_projects = sorted(
    e["name"]
    for e in graph["entities"]
    if e["entityType"] == "project" and "uses python" in e["observations"]
)
maintained = sorted(r["to"] for r in graph["relations"] if r["from"] == "ana")
workspace.write_json("report.json", {"python": python_projects, "ana_maintains": maintained})
print(f"{len(graph['entities'])} entities and {len(graph['relations'])} relations read back")

{"python_projects": python_projects, "maintained_by_ana": maintained}
