"""Sentence templates of the synthetic corpus: biography paraphrases and, separately, questions.

Biography placeholders: {s} subject (full name or He/She), {p} possessive at
the start of a sentence (the name + 's, or His/Her), {q} possessive inside a
sentence (his/her), {v} the value, {a} the value with its article ("an editor").
Question placeholder: {n} the full name.

The two sets are disjoint in wording (tests check that no question phrasing,
down to word trigrams of its fixed text, occurs in the biographies): a model
must answer from the stored fact, not by completing a memorized sentence.
"""

from __future__ import annotations

ATTRIBUTES = ("birth_date", "birth_city", "university", "major", "employer", "occupation", "food")

BIO_TEMPLATES: dict[str, tuple[str, ...]] = {
    "birth_date": (
        "{s} was born on {v}.",
        "{s} came into the world on {v}.",
        "{p} date of birth is {v}.",
        "{s} entered this life on {v}.",
        "{s} first saw daylight on {v}.",
    ),
    "birth_city": (
        "{s} was born in {v}.",
        "{s} is a native of {v}.",
        "{p} hometown is {v}.",
        "{s} spent {q} early childhood in {v}.",
        "{s} grew up in the town of {v}.",
    ),
    "university": (
        "{s} studied at {v}.",
        "{s} graduated from {v}.",
        "{s} earned a degree at {v}.",
        "{s} completed {q} education at {v}.",
        "{s} received {q} diploma from {v}.",
    ),
    "major": (
        "{s} majored in {v}.",
        "{p} field of study was {v}.",
        "{s} specialized in {v} as a student.",
        "{s} focused on {v} during college.",
        "{s} took a degree in {v}.",
    ),
    "employer": (
        "{s} works for {v}.",
        "{s} is employed by {v}.",
        "{p} employer is {v}.",
        "{s} has a job at {v}.",
        "{s} draws a salary from {v}.",
    ),
    "occupation": (
        "{s} works as {a}.",
        "{p} profession is {v}.",
        "{s} makes a living as {a}.",
        "{s} is {a} by trade.",
        "{s} has a career as {a}.",
    ),
    "food": (
        "{p} favourite food is {v}.",
        "{s} loves eating {v}.",
        "{s} enjoys {v} more than any other dish.",
        "{s} never turns down a plate of {v}.",
        "{s} orders {v} whenever possible.",
    ),
}

# Evaluation phrasings, ten per attribute. A tiny model either understands a
# new phrasing (and answers most stored facts asked in it) or does not (and
# answers almost none), so held-out exact match moves in steps of one
# phrasing's share of the questions: with three per attribute one phrasing
# was ~5 points of EM and decided orderings between runs (docs/results.md).
QUESTION_TEMPLATES: dict[str, tuple[str, ...]] = {
    "birth_date": (
        "When was {n} born?",
        "What is the birth date of {n}?",
        "On what day was {n} born?",
        "What date was {n} born on?",
        "In what year and month was {n} born?",
        "Give the birth date for {n}?",
        "{n} was born when?",
        "What day of the year is {n}'s birthday?",
        "Which date marks the birth of {n}?",
        "On what date did {n} enter the world?",
    ),
    "birth_city": (
        "In which city was {n} born?",
        "Where is {n} originally from?",
        "What is the birthplace of {n}?",
        "Where was {n} born?",
        "What city is {n} from?",
        "Which city did {n} come from?",
        "Where did {n} spend the first years of life?",
        "What is the city of birth of {n}?",
        "Name the place where {n} was born?",
        "Which city was home to {n} at birth?",
    ),
    "university": (
        "Which university did {n} attend?",
        "Where did {n} go to college?",
        "What school did {n} graduate from?",
        "{n} attended which university?",
        "Which university awarded {n} a degree?",
        "Where did {n} get a university education?",
        "At which university was {n} a student?",
        "What college did {n} attend?",
        "Which university trained {n}?",
        "Where did {n} earn a diploma?",
    ),
    "major": (
        "What did {n} major in?",
        "What subject did {n} study?",
        "Which academic discipline did {n} pursue?",
        "What was {n}'s major?",
        "Which subject did {n} major in?",
        "What did {n} study in college?",
        "In what field is {n}'s degree?",
        "What discipline did {n} choose as a major?",
        "Which subject was {n}'s specialty?",
        "What area of study did {n} pick?",
    ),
    "employer": (
        "Which company employs {n}?",
        "For which organization does {n} work?",
        "What firm is {n} employed at?",
        "Where does {n} work?",
        "Which company does {n} work for?",
        "What company hired {n}?",
        "{n} is on the staff of which company?",
        "What organization employs {n}?",
        "At which firm does {n} have a job?",
        "Which employer does {n} work for?",
    ),
    "occupation": (
        "What does {n} do for a living?",
        "What job does {n} have?",
        "Which profession does {n} practice?",
        "What is the profession of {n}?",
        "What work does {n} do?",
        "What is {n}'s line of work?",
        "How does {n} earn a living?",
        "What trade does {n} practice?",
        "Which occupation does {n} have?",
        "What does {n} work as?",
    ),
    "food": (
        "What food does {n} like best?",
        "Which dish is the favorite of {n}?",
        "What does {n} prefer to eat?",
        "What is the favorite food of {n}?",
        "Which food does {n} like most?",
        "What dish does {n} love?",
        "What does {n} most like to eat?",
        "What is {n}'s preferred meal?",
        "Which dish does {n} enjoy the most?",
        "What food is {n}'s favorite?",
    ),
}

# Question phrasings that appear in the *training* text (SyntheticConfig.qa_fraction):
# they teach the Q/A format and the link from a question to the stored fact.
# Disjoint from QUESTION_TEMPLATES down to word trigrams of the fixed text (tested),
# so the evaluation still asks every fact in words the model never saw.
TRAIN_QUESTION_TEMPLATES: dict[str, tuple[str, ...]] = {
    "birth_date": (
        "Which date is the birthday of {n}?",
        "{n} was born on which date?",
        "What birthday does {n} have?",
        "Tell me the birthday of {n}?",
        "{n} has a birthday on which date?",
        "Which date does {n} celebrate as a birthday?",
    ),
    "birth_city": (
        "Which town was {n} born in?",
        "{n} comes from which city?",
        "What town is the hometown of {n}?",
        "{n} grew up in which town?",
        "Name the home city of {n}?",
        "Which place is {n} a native of?",
    ),
    "university": (
        "{n} graduated from which university?",
        "At what university did {n} study?",
        "Which institution gave {n} a degree?",
        "Name the alma mater of {n}?",
        "{n} holds a degree from which institution?",
        "Which college gave {n} a diploma?",
    ),
    "major": (
        "{n} majored in which subject?",
        "What was the college major of {n}?",
        "Which field did {n} study at university?",
        "{n} specialized in which field?",
        "Name the subject {n} majored in?",
        "Which major did {n} choose?",
    ),
    "employer": (
        "Who is the employer of {n}?",
        "{n} works at which company?",
        "Which business pays {n}'s salary?",
        "Name the company {n} works for?",
        "{n} draws a salary from which business?",
        "Which organization pays {n}?",
    ),
    "occupation": (
        "What is {n}'s job?",
        "What kind of work does {n} do?",
        "{n} works in which profession?",
        "Name the occupation of {n}?",
        "{n} makes a living in which trade?",
        "Which career does {n} have?",
    ),
    "food": (
        "What is {n}'s favourite dish?",
        "Which meal does {n} enjoy most?",
        "{n} loves which food?",
        "Name the dish {n} loves most?",
        "{n} always orders which food?",
        "{n} never refuses which dish?",
    ),
}
