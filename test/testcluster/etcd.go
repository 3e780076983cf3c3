package testcluster

import (
	"context"
	"errors"
	"fmt"
	"net/url"
	"os"
	"path/filepath"

	"go.etcd.io/etcd/server/v3/embed"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
)

const (
	etcdDataDir = "etcd"
	etcdLogFile = "etcd.log"
)

// embeddedEtcd is a single-member etcd server running inside this process.
type embeddedEtcd struct {
	server *embed.Etcd
	logger *zap.Logger
	log    *os.File
	url    string // client URL for --etcd-servers
}

// startEtcd starts etcd with its data and log in dir. It listens on
// 127.0.0.1 port 0 (client and peer), so it never races another cluster for
// a port; the client URL is read back from the bound listener.
func startEtcd(ctx context.Context, dir string, fsync bool) (*embeddedEtcd, error) {
	logFile, err := os.OpenFile(filepath.Join(dir, etcdLogFile), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return nil, fmt.Errorf("open etcd log: %w", err)
	}
	// Our own logger on our own file: etcd's default would write to stderr
	// (the test output), and one built from a path is never closed.
	encCfg := zap.NewProductionEncoderConfig()
	encCfg.EncodeTime = zapcore.ISO8601TimeEncoder
	logger := zap.New(zapcore.NewCore(zapcore.NewJSONEncoder(encCfg), zapcore.AddSync(logFile), zapcore.InfoLevel))

	local := url.URL{Scheme: "http", Host: "127.0.0.1:0"}
	cfg := embed.NewConfig()
	cfg.Name = "testcluster"
	cfg.Dir = filepath.Join(dir, etcdDataDir)
	cfg.ListenClientUrls = []url.URL{local}
	cfg.AdvertiseClientUrls = []url.URL{local}
	cfg.ListenPeerUrls = []url.URL{local}
	cfg.AdvertisePeerUrls = []url.URL{local}
	cfg.InitialCluster = cfg.InitialClusterFromName(cfg.Name)
	cfg.ListenMetricsUrls = nil
	// Test data is thrown away: skip fsync, the main cost of etcd writes,
	// unless asked (WithEtcdFsync).
	cfg.UnsafeNoFsync = !fsync
	cfg.Logger = "zap"
	cfg.ZapLoggerBuilder = embed.NewZapLoggerBuilder(logger)

	closeLog := func() {
		_ = logger.Sync()
		_ = logFile.Close()
	}
	server, err := embed.StartEtcd(cfg)
	if err != nil {
		closeLog()
		return nil, fmt.Errorf("start etcd: %w", err)
	}
	e := &embeddedEtcd{server: server, logger: logger, log: logFile}

	select {
	case <-server.Server.ReadyNotify():
	case err := <-server.Err():
		e.close()
		return nil, fmt.Errorf("etcd failed while starting: %w", err)
	case <-ctx.Done():
		e.close()
		return nil, fmt.Errorf("wait for etcd: %w", ctx.Err())
	}
	if len(server.Clients) == 0 {
		e.close()
		return nil, errors.New("etcd has no client listener")
	}
	e.url = "http://" + server.Clients[0].Addr().String()
	return e, nil
}

// close stops etcd and closes its log.
func (e *embeddedEtcd) close() {
	e.server.Close()
	_ = e.logger.Sync()
	_ = e.log.Close()
}
