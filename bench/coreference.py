"""Hand-written English documents whose later sentences refer back to what the first one
names, by pronoun ("it", "she") or by definite description ("the city"), never by name;
each with a query that names the referent. Three sentences of 15 to 22 tokens each, so
that chunks of at most 24 tokens are one sentence each. English, because the default
model's vocabulary holds few CJK characters ("服务 A 调用了配置中心 B，因为它需要获取最新配置。"
tokenizes mostly to [UNK]); the "service A" document is that sentence, told in English."""

from dataclasses import dataclass


@dataclass(frozen=True)
class Document:
    query: str
    """names the referent"""
    sentences: tuple[str, ...]
    """the first names it; the others refer back to it"""
    refers_by: tuple[str, ...]
    """how each later sentence refers back"""


DOCUMENTS = [Document(*entry) for entry in [
    ("Berlin", (
        "Berlin is the capital and largest city of Germany, both by area and by population.",
        "Its more than 3.85 million inhabitants make it the most populous city of the Union.",
        "The city is also one of the states of Germany, and the third smallest of them by area."),
     ("its … it", "the city")),
    ("service A", (
        "Service A calls the configuration centre B whenever it starts up on a new machine.",
        "It needs the latest configuration before it can accept any requests from its users.",
        "The service retries every few seconds until the centre answers with a valid reply."),
     ("it", "the service")),
    ("the Eiffel Tower", (
        "The Eiffel Tower stands on the Champ de Mars in Paris and was finished in 1889.",
        "It was built as the entrance arch to the World's Fair that was held in that year.",
        "The tower is 330 metres tall and was the tallest structure in the world for 41 years."),
     ("it", "the tower")),
    ("Marie Curie", (
        "Marie Curie was a physicist and chemist who did pioneering research on radioactivity.",
        "She was the first woman to win a Nobel Prize, and the only person to win it in two sciences.",
        "The scientist died in 1934 of an illness caused by her long exposure to radiation."),
     ("she", "the scientist")),
    ("the Amazon river", (
        "The Amazon in South America is the largest river on Earth by the water it carries.",
        "It flows for more than six thousand kilometres from the Andes to the Atlantic Ocean.",
        "The river and its tributaries drain a basin of about seven million square kilometres."),
     ("it", "the river")),
    ("the Python programming language", (
        "Python is a programming language created by Guido van Rossum and released in 1991.",
        "It favours readable code, with indentation that marks where each block begins and ends.",
        "The language now ranks among the most popular ones for data science and machine learning."),
     ("it", "the language")),
    ("Mount Everest", (
        "Mount Everest, on the border of Nepal and China, is the highest mountain on Earth.",
        "It was first climbed in 1953 by Edmund Hillary and Tenzing Norgay from the south.",
        "The mountain draws hundreds of climbers every spring, and most of them carry oxygen."),
     ("it", "the mountain")),
    ("Jupiter", (
        "Jupiter is the fifth planet from the Sun and the largest one in the Solar System.",
        "It is a gas giant with a mass more than twice that of all the other planets combined.",
        "The planet has a Great Red Spot, a storm that has lasted for hundreds of years."),
     ("it", "the planet")),
    ("Kyoto", (
        "Kyoto served as the capital of Japan for more than a thousand years, until 1869.",
        "It is home to some two thousand temples and shrines, many of them centuries old.",
        "The city draws tens of millions of visitors a year to its gardens and wooden streets."),
     ("it", "the city")),
    ("Ada Lovelace", (
        "Ada Lovelace was an English mathematician who worked with Charles Babbage on his engine.",
        "She wrote what many consider the first published algorithm meant for a machine to run.",
        "The countess is remembered each October on a day that celebrates women in science."),
     ("she", "the countess")),
]]
CHUNK_TOKENS = 24
"""at most one sentence a chunk"""
