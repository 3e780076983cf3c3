// Command nodeprobe is the one program of the test harness's node image
// (test/testcluster's WithNode): the pod sandbox ("pause") container and
// the container the stream tests exec into, attach to and forward ports
// to. It is static, so the image needs no base.
//
//	nodeprobe                 wait for SIGTERM or SIGINT (the pod sandbox)
//	nodeprobe cat             copy standard input to standard output until EOF
//	nodeprobe serve ADDR      echo every TCP connection to ADDR back to it, and
//	                          standard input to standard output, until a signal
package main

import (
	"fmt"
	"io"
	"net"
	"os"
	"os/signal"
	"syscall"
)

func main() {
	signals := make(chan os.Signal, 1)
	signal.Notify(signals, syscall.SIGINT, syscall.SIGTERM)
	args := os.Args[1:]
	switch {
	case len(args) == 0:
	case args[0] == "cat" && len(args) == 1:
		if _, err := io.Copy(os.Stdout, os.Stdin); err != nil {
			fail(err)
		}
		return
	case args[0] == "serve" && len(args) == 2:
		l, err := net.Listen("tcp", args[1])
		if err != nil {
			fail(err)
		}
		go echo(l)
		go func() { _, _ = io.Copy(os.Stdout, os.Stdin) }()
	default:
		fail(fmt.Errorf("usage: nodeprobe [cat | serve ADDR]"))
	}
	<-signals
}

// echo copies what each connection to l sends back to it.
func echo(l net.Listener) {
	for {
		c, err := l.Accept()
		if err != nil {
			return
		}
		go func() {
			defer func() { _ = c.Close() }()
			_, _ = io.Copy(c, c)
		}()
	}
}

func fail(err error) {
	fmt.Fprintln(os.Stderr, "nodeprobe:", err)
	os.Exit(2)
}
