"""The Batch API: files and batches in Redis, their routes, and the runner that sends each line
down the request path."""
