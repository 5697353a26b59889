# expect: ok
# stderr: INFO:pipeline:starting
# stderr: WARNING:pipeline:2 rows dropped
import logging

logging.basicConfig(level=logging.INFO)
log = logging.getLogger("pipeline")
log.info("starting")
rows = [1, None, 3, None, 5]
clean = [r for r in rows if r is not None]
log.warning("%d rows dropped", len(rows) - len(clean))
print(sum(clean))
