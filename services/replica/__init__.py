"""One model replica's serving face, in the scheduler process: its OpenAI endpoints over the async
scheduler core, response building, metrics, engine health supervision and the registry publisher."""
