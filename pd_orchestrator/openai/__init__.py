"""OpenAI/vLLM wire formats shared by the simulator and the gateway."""
