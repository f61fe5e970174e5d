# Spark image of the compose stack (master, worker and the demo job's driver): the official
# Apache Spark image (Java 17, Python) plus spillway-client and spillway-spark, installed in a
# Python >= 3.11 venv that drivers and executors both run (PYSPARK_PYTHON).
# Build context is the repository root (see .dockerignore):
#   docker build -f deploy/spark.Dockerfile -t spillway/spark:4.3.0 .
#
# pyspark itself is the image's own ($SPARK_HOME/python; spark-submit and the executors put it on
# PYTHONPATH), so its version is the cluster's: keep this tag's Spark version equal to the pyspark
# pin in requirements/dev.txt (tests/unit/project/test_compose.py checks it).

FROM apache/spark:4.3.0-scala2.13-java17-python3-ubuntu

USER root
COPY deploy/spark-requirements.txt /tmp/spillway/requirements.txt
COPY client/ /tmp/spillway/client/
COPY spark_integration/ /tmp/spillway/spark_integration/
# The image's python3 is the distribution's (3.10 on Ubuntu 22.04). spillway-spark runs on 3.10
# too, but the pins below are the set the test suite runs on 3.11: add python3.11 where older.
RUN set -eux; \
    apt-get update; \
    if python3 -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then \
        py=python3; apt-get install -y --no-install-recommends python3-venv; \
    else \
        py=python3.11; apt-get install -y --no-install-recommends python3.11 python3.11-venv; \
    fi; \
    rm -rf /var/lib/apt/lists/*; \
    "$py" -m venv /opt/spillway/venv; \
    /opt/spillway/venv/bin/pip install --no-cache-dir --disable-pip-version-check \
        -r /tmp/spillway/requirements.txt; \
    /opt/spillway/venv/bin/pip install --no-cache-dir --disable-pip-version-check --no-deps \
        /tmp/spillway/client /tmp/spillway/spark_integration; \
    rm -rf /tmp/spillway; \
    PYTHONPATH="$(echo "$SPARK_HOME"/python/lib/py4j-*-src.zip):$SPARK_HOME/python" \
        /opt/spillway/venv/bin/python -c \
        'import pyspark, spillway.client, spillway.spark; print("pyspark", pyspark.__version__)'

ENV PYSPARK_PYTHON=/opt/spillway/venv/bin/python \
    PYSPARK_DRIVER_PYTHON=/opt/spillway/venv/bin/python
# the image's own user (spark, uid 185)
USER 185:185
