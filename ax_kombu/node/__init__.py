"""What every ax daemon shares: the node lifecycle (register, beat, lease), its steps and
their supervision. Above the store and the broker, below the scheduler, the worker and the
Celery bootstep."""
