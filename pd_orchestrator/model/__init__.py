"""The ground floor: the types every layer shares (endpoints and their roles, an
endpoint's status and load, a candidate for routing, hardware profiles, the prefix
hash algorithms). Its modules import nothing of the project but ``connectors``;
every other package may import them. See the package map in the README."""
