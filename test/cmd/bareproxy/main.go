// Command bareproxy is the baseline the bench measures the lease gateway
// against: a reverse proxy to the API server that serves as the gateway
// serves and forwards as it forwards, and does nothing else.
//
// Like the gateway it listens with the gateway's TLS profile
// (pki.GatewayTLSConfig: TLS 1.3, a lease certificate required and
// verified against the CA of -client-ca-file), serves with the gateway's
// http.Server settings (the broker's listener defaults, then
// gateway.ConfigureServer: HTTP/2 streams and buffers), forwards with an
// httputil.ReverseProxy over the gateway's upstream transports
// (gateway.NewTransports) and copy buffers (gateway.CopyBuffers) and sets
// the Authorization header to a bearer token. Unlike it, it checks no lease, keeps no token per lease (the one
// of -token-file forwards every request), caps nothing, and writes no
// audit event or metric: what the gateway costs beyond it is what those
// cost. Upgrades (exec, attach, port-forward) are not forwarded; the
// bench sends none.
//
// It is built and started by test/cmd/bench, one process beside the
// broker's, so that the CPU of each is its own.
package main

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"flag"
	"fmt"
	"log"
	"net"
	"net/http"
	"net/http/httputil"
	"net/url"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"k8s.io/client-go/tools/clientcmd"

	"github.com/tokenbroker/tokenbroker/pki"
	"github.com/tokenbroker/tokenbroker/server"
	"github.com/tokenbroker/tokenbroker/server/gateway"
	"github.com/tokenbroker/tokenbroker/test/cmd/internal/baselinesrv"
)

// config is what the command line asks for.
type config struct {
	baselinesrv.Flags
	kubeconfig string
	tokenFile  string
}

func main() {
	var cfg config
	cfg.Register(flag.CommandLine, "lease certificates")
	flag.StringVar(&cfg.kubeconfig, "kubeconfig", "", "kubeconfig of the API server: its server and CA (its credentials are not used)")
	flag.StringVar(&cfg.tokenFile, "token-file", "", "file holding the bearer token every request is forwarded with")
	flag.Parse()
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, cfg); err != nil {
		fmt.Fprintln(os.Stderr, "bareproxy:", err)
		os.Exit(1)
	}
}

func run(ctx context.Context, cfg config) error {
	if cfg.kubeconfig == "" || cfg.tokenFile == "" || cfg.Missing() {
		return errors.New("-kubeconfig, -token-file, -tls-cert-file, -tls-key-file and -client-ca-file are required")
	}
	kube, err := clientcmd.BuildConfigFromFlags("", cfg.kubeconfig)
	if err != nil {
		return fmt.Errorf("load -kubeconfig: %w", err)
	}
	upstream, plain, _, err := gateway.NewTransports(kube)
	if err != nil {
		return err
	}
	raw, err := os.ReadFile(cfg.tokenFile)
	if err != nil {
		return fmt.Errorf("read -token-file: %w", err)
	}
	token := strings.TrimSpace(string(raw))
	if token == "" {
		return errors.New("-token-file is empty")
	}
	certs, roots, err := cfg.LoadTLS()
	if err != nil {
		return err
	}
	ln, err := net.Listen("tcp", cfg.Listen)
	if err != nil {
		return err
	}
	tlsLn := tls.NewListener(ln, pki.GatewayTLSConfig(certs, func() *x509.CertPool { return roots }, time.Now))
	errLog := log.New(os.Stderr, "bareproxy: ", log.LstdFlags)
	srv := &http.Server{
		Handler:           newProxy(upstream, plain, token, errLog),
		ReadHeaderTimeout: server.DefaultReadHeaderTimeout,
		IdleTimeout:       server.DefaultIdleTimeout,
		MaxHeaderBytes:    server.DefaultMaxHeaderBytes,
		ErrorLog:          errLog,
	}
	gateway.ConfigureServer(srv)
	return baselinesrv.Serve(ctx, srv, tlsLn)
}

// newProxy forwards every request to upstream over transport with token,
// as the gateway's proxy does (gateway.Gateway's rewrite): the path as
// it came, the API server's host, the bearer token set.
func newProxy(upstream *url.URL, transport http.RoundTripper, token string, errLog *log.Logger) *httputil.ReverseProxy {
	bearer := "Bearer " + token
	return &httputil.ReverseProxy{
		Rewrite: func(pr *httputil.ProxyRequest) {
			pr.SetURL(upstream)
			pr.Out.URL.Path, pr.Out.URL.RawPath = pr.In.URL.Path, pr.In.URL.RawPath
			pr.Out.Host = upstream.Host
			pr.Out.Header.Set("Authorization", bearer)
		},
		Transport: transport,
		// As the gateway's: a watch is flushed after every write, and
		// answers are copied through the gateway's pooled buffers.
		FlushInterval: 0,
		BufferPool:    gateway.CopyBuffers(),
		ErrorLog:      errLog,
	}
}
