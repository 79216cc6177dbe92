"""Deployment files shipped with the package: the Kafka runtime pom, docker-compose."""
