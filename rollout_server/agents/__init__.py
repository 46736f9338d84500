"""Example agents for ``agent`` jobs: ordinary ``openai``-client code, run by ``rollout_server.agent_runner``."""
