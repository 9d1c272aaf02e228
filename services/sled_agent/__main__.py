from services.sled_agent.main import main
from shared import service

service.run("sled-agent", main)
