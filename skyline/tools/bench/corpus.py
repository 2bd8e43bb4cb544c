"""Plain English text the benchmark builds its prompts from.

The passages were written for this project and are dedicated to the public
domain (CC0). They ship as Python so they are always installed with Skyline:
a benchmark that needs a download, or that feeds random token ids, measures
something else than real prompts (random ids tokenize oddly, and some engines
short-cut repeated tokens). Each passage is a self-contained paragraph on an
everyday subject, so a RAG-style prompt (several passages + a question) reads
like a retrieval result.
"""

from __future__ import annotations

PASSAGES: tuple[str, ...] = (
    "The lighthouse at the end of the northern pier was built of grey granite blocks hauled by cart from a "
    "quarry two valleys away. For most of its life a keeper lived in the small house at its foot, climbing the "
    "spiral stair at dusk to light the lamp and again at dawn to put it out. The lamp burned paraffin, and the "
    "great glass lens around it turned on a bath of mercury so that a single flame could be seen as a flash "
    "every ten seconds from twenty miles out at sea. Sailors learned to tell one light from another by the "
    "rhythm of its flashes, and the pattern of this one was printed in every chart of the coast.",

    "Bread is made from four things: flour, water, salt and yeast. When the flour is wetted, two of its proteins "
    "join into a stretchy network called gluten. Kneading lines that network up into long strands, and the yeast, "
    "feeding on sugars in the flour, releases carbon dioxide that the strands trap as bubbles. A slow rise in a "
    "cool kitchen gives the yeast and bacteria time to make the acids and alcohols that give bread its flavour. "
    "In the oven the trapped gas expands, the starch sets, and the outside browns as sugars and proteins react, "
    "which is why a crust smells so different from the crumb inside it.",

    "A river carries far more than water. After heavy rain it lifts sand, silt and pebbles from its bed and banks "
    "and moves them downstream, dropping the heaviest pieces first where the current slows. On the inside of a "
    "bend the water moves slowly and leaves a beach of gravel; on the outside it runs fast and cuts into the bank. "
    "Over many years this pushes the bend further sideways until the river may break through the narrow neck of "
    "land between two bends, leaving the old loop behind as a curved lake. Maps drawn a century apart often show "
    "the same river in a noticeably different place.",

    "Honey bees keep the temperature of their brood nest close to thirty-five degrees whatever the weather "
    "outside. On cold days the workers cluster over the comb and shiver their flight muscles without moving "
    "their wings, producing heat. On hot days they fetch water, spread it in thin films over the cells and fan "
    "their wings at the entrance so that the evaporation cools the hive. A colony works as a single body in this "
    "way, with no bee in charge: each worker responds to the temperature and smells around her, and the result "
    "of thousands of small decisions is a nursery held steady within a degree.",

    "The first public libraries lent books to anyone who lived in the town, free of charge, paid for out of local "
    "taxes. Before them most books were kept in the private collections of wealthy families, colleges and "
    "churches, or in subscription libraries that charged a yearly fee. Librarians soon found that readers wanted "
    "novels and travel stories as much as sermons and science, and the catalogues grew to match. Reading rooms "
    "with newspapers stayed open in the evening so that people who worked during the day could use them, and "
    "many towns built their library on the main square as a matter of civic pride.",

    "A mechanical clock keeps time by letting a wound spring or a falling weight release its energy in small, "
    "equal steps. The part that does this is the escapement: a toothed wheel that is allowed to advance by one "
    "tooth each time a pendulum or balance wheel swings. Because a pendulum of a given length swings at nearly the "
    "same rate whatever the size of its swing, the clock ticks evenly even as the spring runs down. Clockmakers "
    "corrected for heat, which lengthens the pendulum rod and slows the clock, by building rods from two metals "
    "that expand by different amounts and cancel each other out.",

    "Tea and coffee reached European cities at about the same time, carried by merchant ships from distant ports. "
    "Coffee houses became places where merchants met to trade, where news was read aloud and where ships and "
    "cargoes were insured. Tea, more expensive at first, was drunk at home and became a household ritual with its "
    "own pots, cups and hours of the day. Both drinks changed daily life: they replaced weak beer as the ordinary "
    "drink of working people, and the need to boil the water for them made them safer than the water that came "
    "from many town wells.",

    "Glaciers form where more snow falls in winter than melts in summer. Year after year the snow is buried and "
    "pressed into dense ice, and once the ice is thick enough it begins to flow downhill under its own weight, "
    "slowly, like very stiff dough. As it moves it plucks rocks from the ground beneath and drags them along, "
    "scraping the bedrock into smooth slabs marked with long parallel scratches. When the climate warms and the "
    "glacier retreats, it leaves behind the rubble it carried in long ridges, and boulders the size of houses "
    "sitting alone in fields far from any rock of their kind.",

    "A well-kept vegetable garden changes through the year. In early spring the gardener sows peas, lettuce and "
    "radishes, which tolerate cold soil; tomatoes, beans and squash wait until the last frost has passed. Crops "
    "are moved to a different bed each year, because plants of one family draw the same nutrients from the soil "
    "and share the same pests. Beans and peas leave the soil richer than they found it, since bacteria in small "
    "swellings on their roots capture nitrogen from the air. In autumn the beds are covered with compost or "
    "straw, which feeds the soil and keeps the winter rain from washing it away.",

    "The postal service of a large country is a problem of sorting. Letters arrive at local offices from every "
    "direction, are gathered at regional centres and sorted by destination, travel overnight by train, truck or "
    "aircraft, and are sorted again, more finely, at the other end until each bundle matches one carrier's round. "
    "Postal codes were introduced so that machines, and later cameras reading handwriting, could do most of this "
    "work. A letter posted in the afternoon can cross the country and arrive the next morning only because every "
    "step of this chain runs to a timetable measured in minutes.",

    "Owls hunt mostly at night and rely on hearing as much as on sight. The feathers of the face form a shallow "
    "dish that gathers sound towards the ears, and in many species one ear opening sits higher on the head than "
    "the other. A sound from below reaches the two ears at slightly different times and strengths, and the owl's "
    "brain turns those differences into a precise position, so that it can strike a mouse moving under snow that "
    "it cannot see at all. Soft fringes on the edges of the wing feathers break up the rush of air, letting the "
    "owl approach its prey almost without a sound.",

    "Early railways ran on their own local time. Each town set its clocks by the sun, so noon in a western town "
    "came several minutes after noon in an eastern one, and a printed timetable had to say whose clock it meant. "
    "As lines grew longer and trains faster the confusion caused missed connections and, worse, collisions on "
    "single tracks. The railway companies agreed to run on one standard time, sent down the telegraph wires from "
    "an observatory each day, and towns gradually followed. Time zones, a later refinement, divided the world "
    "into bands one hour apart so that clock noon stays close to the sun's noon everywhere.",

    "Paper is a mat of plant fibres. The papermaker beats rags, wood or straw in water until the fibres separate "
    "and swell, then dips a fine screen into the vat and lifts out a thin, even layer of pulp. As the water drains "
    "the fibres lock together; the sheet is pressed between felts to squeeze out more water and hung up to dry. "
    "The faint lines that can be seen when old paper is held against the light are the marks of the wires of the "
    "screen. Paper made from rags lasts for centuries, while cheap paper made from ground wood contains acids that "
    "turn it yellow and brittle within a few decades.",

    "A choir learns a new piece in sections. The sopranos, altos, tenors and basses first rehearse their own lines "
    "separately, often with a piano playing their part, until each singer can hold the notes without help. Only "
    "then are the parts put together, and the real work begins: listening across the room, matching vowels so "
    "that the sound blends, agreeing on where to breathe and how long to hold the last chord. A conductor shapes "
    "the tempo and the balance between parts, but a good choir also listens to itself, and small adjustments "
    "made by every singer at once are what make a performance sound effortless.",

    "The tides are raised mainly by the moon. Its gravity pulls slightly harder on the side of the earth facing "
    "it than on the centre, and slightly less on the far side, so the oceans bulge on both sides. As the earth "
    "turns beneath these bulges most coasts see two high tides and two low tides each day, about fifty minutes "
    "later each day because the moon moves along its orbit. When the sun and moon line up, at new and full moon, "
    "their pulls add and the tides run highest; at the quarter moons they partly cancel. The shape of a bay can "
    "amplify the rise until the water climbs many metres twice a day.",

    "Wool is spun into yarn by drawing out a loose bundle of fibres and twisting it. The twist makes the short "
    "fibres grip one another, so that a strand many metres long can be made from fibres only a few centimetres "
    "in length. For thousands of years this was done with a hand spindle, a weighted stick set spinning and left "
    "to hang while the spinner fed out fibre. The spinning wheel made the work several times faster, and later "
    "machines in mills spun hundreds of threads at once. Two or more strands twisted together in the opposite "
    "direction make a plied yarn that is stronger and does not kink.",

    "Volcanic islands are born on the sea floor. Molten rock rises through a crack or over a hot spot in the "
    "mantle and piles up as lava until, after thousands of eruptions, the mountain breaks the surface. Waves "
    "grind the new rock into black sand, birds bring seeds, and within a few years the first plants take hold "
    "in the cracks. When the plate beneath the island carries it away from the hot spot, the volcano goes quiet, "
    "cools and slowly sinks, and in warm seas a ring of coral may keep growing upward around it, so that long "
    "after the island itself has gone a lagoon remains.",

    "A good map leaves things out. The mapmaker chooses what the reader needs, roads for a driver, contour lines "
    "for a walker, depths and lights for a sailor, and draws everything else lightly or not at all. Every flat "
    "map of the round earth also distorts something: one projection keeps the shapes of coastlines true but "
    "swells the lands near the poles, another keeps areas true but stretches shapes. Navigators preferred charts "
    "on which a line of constant compass bearing is straight, even though it made the far north look enormous, "
    "because a straight line on their chart was a course they could actually steer.",
)

# Short chat requests: the kind of one-line question an assistant gets.
QUESTIONS: tuple[str, ...] = (
    "Why does bread need to rise before it is baked?",
    "How does a lighthouse keeper make the light flash?",
    "What makes a river change its course over time?",
    "How do bees keep their hive warm in winter?",
    "Why were public libraries important to towns?",
    "How does a pendulum clock keep accurate time?",
    "What changed when coffee houses opened in cities?",
    "How does a glacier move a boulder far from home?",
    "Why should vegetable crops be rotated every year?",
    "What do postal codes make easier for the post office?",
    "How can an owl find a mouse hidden under snow?",
    "Why did railways need a standard time?",
    "Why does cheap paper turn yellow so quickly?",
    "How does a choir learn a difficult new piece?",
    "Why are there two high tides on most days?",
    "What does twisting do to wool fibres when spinning?",
    "How does a volcanic island first appear?",
    "Why does every flat map distort something?",
    "Give me three tips for baking a crusty loaf at home.",
    "Explain in simple words what an escapement is.",
    "Write a short poem about a lighthouse at night.",
    "Summarise how paper is made by hand.",
    "What is the difference between spring tides and neap tides?",
    "Suggest a name for a small seaside bakery.",
)

# The multi-turn workload's shared system prompt (skyline.tools.bench.multiturn): every conversation
# and RAG question starts with it, as an assistant product's requests do, so engines see one common
# prefix that every cache holds.
SYSTEM_PROMPT = (
    "You are the reference assistant of a small public library. You answer questions from members of the "
    "public about everyday subjects: cooking, nature, history, crafts and the workings of ordinary things. "
    "Answer in plain English, in a few short paragraphs, without jargon. When a question is about a document "
    "the member has shared, answer from that document only and say which numbered passage you used; if the "
    "document does not say, answer that it does not. When a member asks a follow-up question, keep to what "
    "was said before in the conversation and do not repeat earlier answers. Be friendly and brief."
)
