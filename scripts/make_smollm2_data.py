"""Generate the smollm2 recipe's task data and retention set (data/smollm2/*.jsonl).

Task: extract a person record from one sentence as a JSON object with fixed keys and key order,
    "Extract name, age, city and job as JSON: Meet Lena Fischer, 41, who works as a baker in Porto."
 -> {"name": "Lena Fischer", "age": 41, "city": "Porto", "job": "baker"}
SmolLM2-135M-Instruct understands the request but answers in prose, with other keys, or with a
wrong value; a short fine-tune teaches the exact format and the extraction. The held-out items
use first names, surnames, cities and jobs that never occur in training (disjoint word lists)
and two sentence shapes that never occur in training, so a correct answer on them means the model
extracts, not recalls. Scored by json_fields: the answer parses as a JSON object and every
reference field is equal.

Retention: short factual questions (capitals, arithmetic, common knowledge) answered by the
base model, scored by `contains` on the reference word. They share nothing with the task; the
fine-tuned model must keep answering them (check enforces eval's max_drop on this set). The set is not
filtered by the base model's answers: SmolLM2-135M gets about three quarters right, and the number that matters
is the difference. Numbers accept digits or words (a list of references: any match counts).

Preference pairs (recipe smollm2_dpo) need the SFT model's answers: scripts/make_smollm2_dpo_pairs.py writes them
after the smollm2 run, from the third vocabulary and sentence shapes below (D_*, disjoint from both the SFT training
data and the held-out set) and, where the SFT model answers a held-out prompt right, one synthetic mistake
(wrong_record).

Run: python scripts/make_smollm2_data.py   (output is committed; rerunning is deterministic)
"""

import json
import random
from pathlib import Path

FIRST = ("Anna Ben Carla David Elena Felix Greta Hugo Ines Jonas Klara Leo Maria Nils Olga Paul Rosa Sven Tara "
         "Umar Vera Walter Yara Zoe Amir Bianca Carlos Dora Emil Farah Gino Hanna Igor Julia Karim Lucia Marco "
         "Nora Oscar Pia Agnes Bertil Cosima Dagny Eskil Frida Gunnar Helka Ingmar Jutta Kasimir Liesel Magnus "
         "Ottilie Quirin Runa Sigrid Thorsten Ulla Viggo Wilma Xaver Ylva Zenobia Aurelio Benedikta Cyrus Delphine "
         "Evander Fiorella Gideon Hortense Isidor Jolanda Leopold Marisol Nikodem Orsolya").split()
LAST = ("Smith Weber Rossi Novak Jensen Costa Silva Berg Keller Moreau Fischer Romano Larsen Horvat Nowak Dubois "
        "Schmidt Ferrari Lindqvist Kowalski Santos Meyer Conti Hansen Martin Bauer Ricci Nielsen Dvorak Garcia").split()
CITIES = ("Paris Berlin Madrid Rome Vienna Prague Oslo Dublin Lisbon Athens Warsaw Zurich Munich Milan Lyon "
          "Hamburg Seville Naples Krakow Bergen Geneva Turin Bordeaux Valencia Cologne").split()
JOBS = ("teacher nurse baker pilot lawyer farmer chef dentist plumber architect painter journalist librarian "
        "mechanic pharmacist carpenter engineer florist butcher tailor locksmith beekeeper cartographer "
        "upholsterer veterinarian blacksmith stonemason bookbinder clockmaker farrier glassblower saddler "
        "chandler cooper tanner weaver optician midwife surveyor typesetter").split()
# held out: never seen in training
H_FIRST = "Astrid Bruno Celia Dario Edith Fabian Gloria Henrik Ilse Jasper Kira Lorenzo Mira Otto Selma".split()
H_LAST = "Vogel Marino Eriksen Kral Lambert Moretti Olsen Pereira Szabo Winter".split()
H_CITIES = "Porto Ghent Malmo Bologna Graz Split Tallinn Bruges Utrecht Lucerne".split()
H_JOBS = "welder surgeon potter cashier jeweller sculptor glazier tiler".split()

TRAIN_SHAPES = [
    "{name} is a {age}-year-old {job} from {city}.",
    "Meet {name}, {age}, who works as a {job} in {city}.",
    "{name} ({age}) lives in {city} and works as a {job}.",
    "A {job} named {name}, aged {age}, is based in {city}.",
    "Born {age} years ago, {name} now works as a {job} in {city}.",
    "In {city} lives {name}, a {job} who is {age} years old.",
]
HELDOUT_SHAPES = [
    "{name}, a {job} aged {age}, has made a home in {city}.",
    "Our new neighbour in {city} is {name}; the {job} turned {age} this spring.",
]
PROMPT = "Extract name, age, city and job as JSON: {sentence}"
# preference pairs (smollm2_dpo): a third vocabulary and sentence shapes, disjoint from training and held-out
D_FIRST = "Alma Boris Cecilia Dmitri Esther Filippo Greer Hamish Irene Joakim Kamila Luuk Matilde Niamh Oriol".split()
D_LAST = "Aalto Brennan Castillo Duarte Engel Falk Gruber Haas Ivanova Jovanovic Kuiper Lindgren Mazur Nyberg".split()
D_CITIES = "Antwerp Basel Cork Dresden Espoo Faro Gdansk Haarlem Innsbruck Kaunas Leiden Maastricht".split()
D_JOBS = "sommelier falconer luthier archivist cobbler ropemaker wheelwright bellfounder miller tinsmith".split()
D_SHAPES = [
    "{name}, {age}, is a {job} living in {city}.",
    "Living in {city}, {name} works as a {job} and is {age}.",
    "The {job} {name} ({age}) calls {city} home.",
]

RETENTION = [
    ("What is the capital of France?", "Paris"),
    ("What is the capital of Italy?", "Rome"),
    ("What is the capital of Japan?", "Tokyo"),
    ("What is the capital of Germany?", "Berlin"),
    ("What is the capital of Spain?", "Madrid"),
    ("What is the capital of England?", "London"),
    ("What is the capital of Russia?", "Moscow"),
    ("What is the capital of Egypt?", "Cairo"),
    ("What is the capital of China?", "Beijing"),
    ("What is the capital of Greece?", "Athens"),
    ("What is the largest planet in our solar system?", "Jupiter"),
    ("Which planet is known as the Red Planet?", "Mars"),
    ("What is the chemical symbol for gold?", "Au"),
    ("What is the chemical formula for water?", "H2O"),
    ("What gas do plants absorb from the air?", "carbon dioxide"),
    ("What is the boiling point of water in degrees Celsius?", "100"),
    ("How many days are there in a week?", ["seven", "7"]),
    ("How many continents are there?", ["seven", "7"]),
    ("What is 2 + 2?", ["4", "four"]),
    ("What is 10 times 10?", ["100", "one hundred"]),
    ("Who wrote Romeo and Juliet?", "Shakespeare"),
    ("Who painted the Mona Lisa?", "Leonardo"),
    ("What is the largest ocean on Earth?", "Pacific"),
    ("What is the tallest mountain in the world?", "Everest"),
    ("What is the longest river in Africa?", "Nile"),
    ("What color is the sky on a clear day?", "blue"),
    ("What do bees make?", "honey"),
    ("What is the opposite of hot?", "cold"),
    ("What is the freezing point of water in degrees Celsius?", ["0", "zero"]),
    ("Which animal is known as the king of the jungle?", "lion"),
    ("What is the main language spoken in Brazil?", "Portuguese"),
    ("What is the currency of Japan?", "yen"),
    ("Which star is at the center of our solar system?", "Sun"),
    ("What organ pumps blood through the human body?", "heart"),
    ("How many legs does a spider have?", ["eight", "8"]),
    ("What is the square root of 9?", ["3", "three"]),
    ("Who was the first person to walk on the Moon?", "Armstrong"),
    ("In which country are the pyramids of Giza?", "Egypt"),
    ("What is the hardest natural substance?", "diamond"),
    ("What is the smallest prime number?", ["2", "two"]),
]


def person(rng, first, last, cities, jobs) -> dict:
    return {"name": f"{rng.choice(first)} {rng.choice(last)}", "age": rng.randint(19, 79),
            "city": rng.choice(cities), "job": rng.choice(jobs)}


def example(rng, p: dict, shapes) -> tuple[str, str]:
    sentence = rng.choice(shapes).format(**p)
    return PROMPT.format(sentence=sentence), json.dumps(p)


def main() -> None:
    rng = random.Random(0)
    out = Path(__file__).resolve().parents[1] / "data" / "smollm2"
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "train.jsonl", "w") as f:
        for _ in range(2000):
            prompt, answer = example(rng, person(rng, FIRST, LAST, CITIES, JOBS), TRAIN_SHAPES)
            f.write(json.dumps({"messages": [{"role": "user", "content": prompt},
                                             {"role": "assistant", "content": answer}]}) + "\n")
    with open(out / "heldout.jsonl", "w") as f:
        for _ in range(60):
            prompt, answer = example(rng, person(rng, H_FIRST, H_LAST, H_CITIES, H_JOBS), HELDOUT_SHAPES)
            f.write(json.dumps({"messages": [{"role": "user", "content": prompt}], "answer": answer}) + "\n")
    with open(out / "retention.jsonl", "w") as f:
        for q, a in RETENTION:
            f.write(json.dumps({"messages": [{"role": "user", "content": q}], "answer": a}) + "\n")
    # the third vocabulary stays disjoint from both (make_smollm2_dpo_pairs.py draws its prompts from it)
    for d, used in ((D_FIRST, FIRST + H_FIRST), (D_LAST, LAST + H_LAST), (D_CITIES, CITIES + H_CITIES),
                    (D_JOBS, JOBS + H_JOBS), (D_SHAPES, TRAIN_SHAPES + HELDOUT_SHAPES)):
        assert not set(d) & set(used), set(d) & set(used)


def wrong_record(rng, p: dict) -> str:
    """A plausible wrong answer for person p, one synthetic mistake: a training city or job, the name cut, the age off,
    the job capitalised, prose after the JSON."""
    q = dict(p)
    kind = rng.choice(["city", "job", "name", "age", "case", "prose"])
    if kind == "city":
        q["city"] = rng.choice([c for c in CITIES if c != p["city"]])
    elif kind == "job":
        q["job"] = rng.choice([j for j in JOBS if j != p["job"]])
    elif kind == "name":
        q["name"] = p["name"].split()[0]
    elif kind == "age":
        q["age"] = p["age"] + rng.choice([-10, -1, 1, 10])
    elif kind == "case":
        q["job"] = p["job"].capitalize()
    text = json.dumps(q)
    return text + " This JSON object lists the person's details." if kind == "prose" else text


if __name__ == "__main__":
    main()
