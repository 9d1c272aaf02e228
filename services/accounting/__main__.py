from services.accounting.main import main
from shared import service

service.run("accounting", main)
