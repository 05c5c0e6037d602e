"""The wire: protocol v1 framing and validation, message kinds, socket setup. Every role depends on this
package and on no other role."""
from .messages import SCHEMAS, EnvSpec, Segment, check_header, make, parse, segment_dims
from .protocol import PROTOCOL_VERSION, Message, WireError, decode, encode, pack, unpack
from .sockets import CreditPirate, DropCounter, LazyPirate, bind, make_socket, recv_frames, tcp

__all__ = [
    "PROTOCOL_VERSION", "SCHEMAS", "CreditPirate", "DropCounter", "EnvSpec", "LazyPirate", "Message",
    "Segment", "WireError", "bind", "check_header", "decode", "encode", "make", "make_socket", "pack",
    "parse", "recv_frames", "segment_dims", "tcp", "unpack",
]
